"""Validation on 2 CPU processes: outputs gathered in dataset order, and exact metrics with torchmetrics.

Two ways to get a metric over the whole validation set, each sample counted once:

* ``eval_mode="pad"`` (the default): ranks run the same number of steps, so a few samples are evaluated
  twice; ``self.trainer.strategy.gather_in_order`` drops those repeats and returns every rank's outputs in
  dataset order. Any metric can then be computed from the whole set (here recall@1 of the embeddings).
* ``eval_mode="exact"``: every sample is evaluated once, on one rank; ranks may run different numbers of
  steps, so nothing may communicate inside ``validation_step``. A torchmetrics metric updated per step and
  logged per epoch synchronises at the epoch end only, and is exact.

The script checks both against a single-process pass. Run it: ``python docs/examples/evaluation.py``.
"""
from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
import torchmetrics
from torch.utils.data import DataLoader, Dataset

from lightning_ddp_ext import CustomDDP

SIZE = 45  # odd: 2 ranks need one padding sample in "pad" mode, and get 23 + 22 samples in "exact" mode


class Points(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.labels = torch.arange(SIZE) % 3
        self.features = torch.randn(SIZE, 4, generator=generator) + self.labels[:, None].float()

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features[index], self.labels[index]


def recall_at_1(embeddings: torch.Tensor, labels: torch.Tensor) -> float:
    """The share of samples whose nearest other sample has the same label."""
    distances = torch.cdist(embeddings, embeddings).fill_diagonal_(float("inf"))
    return (labels[distances.argmin(dim=1)] == labels).float().mean().item()


class Model(pl.LightningModule):
    def __init__(self, expected_recall: float = float("nan")) -> None:
        super().__init__()
        self.expected_recall = expected_recall
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(4, 3)
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
        self.embeddings: list[torch.Tensor] = []

    def validation_step(self, batch: tuple, batch_idx: int) -> None:
        x, y = batch
        embeddings = self.embed(x)
        self.embeddings.append(embeddings)
        self.accuracy.update(embeddings.argmax(dim=1), y)  # no communication here
        self.log("accuracy", self.accuracy, on_step=False, on_epoch=True)  # synchronised at the epoch end

    def on_validation_epoch_end(self) -> None:
        everything = self.trainer.strategy.gather_in_order(torch.cat(self.embeddings))  # all ranks, in order
        self.embeddings.clear()
        assert len(everything) == SIZE  # each sample once, in dataset order, on every rank
        labels = self.trainer.val_dataloaders.dataset.labels
        recall = recall_at_1(everything, labels)
        assert abs(recall - self.expected_recall) < 1e-6, (recall, self.expected_recall)
        self.log("recall@1", recall, sync_dist=True)  # every rank computed the same value: averaging keeps it


def single_process() -> dict[str, float]:
    model, data = Model(), Points()
    with torch.no_grad():
        embeddings = model.embed(data.features)
    accuracy = (embeddings.argmax(dim=1) == data.labels).float().mean().item()
    return {"recall@1": recall_at_1(embeddings, data.labels), "accuracy": accuracy}


def main() -> int:
    expected = single_process()
    for eval_mode in ("pad", "exact"):
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=CustomDDP(start_method="fork", eval_mode=eval_mode),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        model = Model(expected["recall@1"])
        metrics = trainer.validate(model, DataLoader(Points(), batch_size=4), verbose=False)[0]
        print(
            f"eval_mode={eval_mode!r}: recall@1 {metrics['recall@1']:.4f}, accuracy {metrics['accuracy']:.4f}"
            f" (one process: {expected['recall@1']:.4f}, {expected['accuracy']:.4f})"
        )
    # "exact" counts each sample once, so the metric synchronised by torchmetrics is the single-process one;
    # in "pad" mode the repeated sample is counted twice by any metric that does not drop repeats.
    assert abs(metrics["accuracy"] - expected["accuracy"]) < 1e-6
    return 0


if __name__ == "__main__":
    sys.exit(main())
