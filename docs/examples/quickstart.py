"""Quickstart: a custom batch sampler on 2 CPU processes with ``strategy="ddp_custom_sampler"``.

Run it as a script: ``python docs/examples/quickstart.py``. The default launcher starts rank 1 by running
this same command again, so the training code sits under ``if __name__ == "__main__"``.
"""
from __future__ import annotations

from typing import Dict, Iterator, List

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_ddp_ext  # noqa: F401  (registers "ddp_custom_sampler" and its variants)
from lightning_ddp_ext.sync import sync_dicts


class Points(Dataset):
    """96 points in 4 classes; an item is (features, label, dataset index)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.labels = torch.arange(96) % 4
        self.features = torch.randn(96, 8, generator=generator) + self.labels[:, None].float()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.features[index], self.labels[index], index


class ClassBalancedBatches:
    """P classes x K items per batch. No BatchSampler base class, no `sampler` argument: stock Lightning
    refuses it under DDP. It needs only `__len__`, `__iter__` and, for a new draw every epoch, `set_epoch`."""

    def __init__(self, labels: List[int], p: int, k: int, seed: int = 0) -> None:
        self.p, self.k, self.seed, self.epoch = p, k, seed, 0
        self.by_class: Dict[int, List[int]] = {}
        for index, label in enumerate(labels):
            self.by_class.setdefault(label, []).append(index)
        self.num_batches = len(labels) // (p * k)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[List[int]]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)  # the same draw on every rank
        classes = sorted(self.by_class)
        for _ in range(self.num_batches):
            batch: List[int] = []
            for c in torch.randperm(len(classes), generator=generator)[: self.p].tolist():
                members = self.by_class[classes[c]]
                batch += [members[i] for i in torch.randperm(len(members), generator=generator)[: self.k].tolist()]
            yield batch


class Embedder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.trained_on: List[List[int]] = []
        self.val_outputs: List[torch.Tensor] = []

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.trained_on.append(index.tolist())
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: tuple, batch_idx: int) -> None:
        x, _, _ = batch
        self.val_outputs.append(self.net(x))

    def on_validation_epoch_end(self) -> None:
        # Every rank's outputs, in dataset order, each sample once (the strategy knows what each rank evaluated).
        outputs = self.trainer.strategy.gather_in_order(torch.cat(self.val_outputs))
        self.val_outputs.clear()
        if not self.trainer.sanity_checking:  # the sanity check runs only the first two batches
            assert outputs.shape == (len(self.trainer.val_dataloaders.dataset), 4)

    def on_train_end(self) -> None:
        per_rank = sync_dicts({"batches": [self.trained_on]})["batches"]  # one list per rank, in rank order
        if self.global_rank == 0:
            first_epoch = len(per_rank[0]) // self.trainer.max_epochs
            print(f"rank 0 trained on {len(per_rank[0])} batches, rank 1 on {len(per_rank[1])}")
            print("first batches:", per_rank[0][0], per_rank[1][0])
            epoch_0 = [batch for rank in per_rank for batch in rank[:first_epoch]]
            assert len({tuple(batch) for batch in epoch_0}) == len(epoch_0), "a batch was trained on twice"

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


if __name__ == "__main__":
    train = Points()
    loader = DataLoader(train, batch_sampler=ClassBalancedBatches(train.labels.tolist(), p=2, k=4))
    val_loader = DataLoader(Points(), batch_size=16)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_custom_sampler",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(Embedder(), loader, val_loader)
