"""Metric learning on 2 CPU processes with a P x K batch sampler and strategy="ddp_custom_sampler".

The batch sampler below subclasses nothing and builds class-balanced batches itself: stock Lightning
refuses it under DDP ("can't inject a (distributed) sampler into your batch sampler"). Here it is used as
written; each rank receives every other batch. After training the script prints how many batches each
rank trained on, checks that the ranks' batches were disjoint and together were exactly the sampler's
sequence, and reports recall@1 on validation embeddings gathered from both ranks in dataset order.

Run: ``make demo`` (or ``python examples/demo_pk_digits.py`` in an environment with the package and
scikit-learn, which the ``demo`` extra installs).
"""
from __future__ import annotations

import argparse
from collections import Counter
from typing import Dict, Iterator, List

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, Dataset

import lightning_ddp_ext  # noqa: F401  (registers "ddp_custom_sampler")
from lightning_ddp_ext.sync import gather_in_order, sync_dicts


class Digits(Dataset):
    """scikit-learn's bundled 8x8 digits (no download): returns (pixels, label, dataset index)."""

    def __init__(self, train: bool) -> None:
        data = load_digits()
        features = torch.tensor(data.data, dtype=torch.float32) / 16.0
        labels = torch.tensor(data.target)
        keep = torch.arange(len(labels)) % 5 != 0 if train else torch.arange(len(labels)) % 5 == 0
        self.features, self.labels = features[keep], labels[keep]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.features[index], self.labels[index], index


class ClassBalancedBatches:
    """P classes x K samples per batch, reseeded every epoch; a plain class, no BatchSampler, no `sampler`."""

    def __init__(self, labels: List[int], p: int, k: int, seed: int = 0) -> None:
        self.p, self.k, self.seed, self.epoch = p, k, seed, 0
        self.num_batches = len(labels) // (p * k)
        self.by_class: Dict[int, List[int]] = {}
        for index, label in enumerate(labels):
            self.by_class.setdefault(label, []).append(index)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[List[int]]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)  # same draw on every rank
        classes = sorted(self.by_class)
        for _ in range(self.num_batches):
            batch: List[int] = []
            for c in torch.randperm(len(classes), generator=generator)[: self.p].tolist():
                members = self.by_class[classes[c]]
                batch.extend(members[i] for i in torch.randperm(len(members), generator=generator)[: self.k].tolist())
            yield batch


def batch_hard_triplet_loss(embeddings: torch.Tensor, labels: torch.Tensor, margin: float = 0.2) -> torch.Tensor:
    distances = torch.cdist(embeddings, embeddings)
    same = labels[:, None] == labels[None, :]
    hardest_positive = (distances * same).max(dim=1).values
    hardest_negative = distances.masked_fill(same, float("inf")).min(dim=1).values
    return F.relu(hardest_positive - hardest_negative + margin).mean()


def recall_at_1(embeddings: torch.Tensor, labels: torch.Tensor) -> float:
    distances = torch.cdist(embeddings, embeddings).fill_diagonal_(float("inf"))
    return (labels[distances.argmin(dim=1)] == labels).float().mean().item()


class Embedder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
        self.train_batches: Dict[int, List[List[int]]] = {}
        self.val_outputs: List[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.recalls: List[float] = []
        self.report: Dict[str, object] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(x), dim=1)

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.train_batches.setdefault(self.current_epoch, []).append(index.tolist())
        loss = batch_hard_triplet_loss(self(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple, batch_idx: int) -> None:
        x, y, index = batch
        self.val_outputs.append((self(x), y, index))

    def on_validation_epoch_end(self) -> None:
        embeddings, labels, indices = (torch.cat(parts) for parts in zip(*self.val_outputs))
        self.val_outputs.clear()
        # Both ranks' embeddings, ordered by dataset index, padding duplicates dropped.
        dataset_size = len(self.trainer.val_dataloaders.dataset)
        embeddings = gather_in_order(embeddings, indices, dataset_size=dataset_size)
        labels = gather_in_order(labels, indices, dataset_size=dataset_size)
        recall = recall_at_1(embeddings, labels)
        if not self.trainer.sanity_checking:
            self.recalls.append(recall)
        # The same value on every rank (computed from the gathered embeddings): sync_dist averages equal values,
        # and tells Lightning the epoch-level value is meant for all ranks (it warns otherwise).
        self.log("recall@1", recall, prog_bar=True, sync_dist=True)

    def on_train_end(self) -> None:
        per_rank = sync_dicts({"batches": [self.train_batches]})["batches"]  # one dict per rank, rank order
        self.report = {"per_rank": per_rank, "recalls": self.recalls}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def check_partition(per_rank: List[Dict[int, List[List[int]]]], sampler: ClassBalancedBatches) -> None:
    """Each epoch, the ranks' batches together must be the sampler's sequence, each batch once (plus padding)."""
    print("\nbatches per rank and epoch:")
    for epoch in sorted(per_rank[0]):
        sampler.set_epoch(epoch)
        expected = [tuple(b) for b in sampler]
        dealt = [tuple(b) for rank_batches in per_rank for b in rank_batches[epoch]]
        padding = len(dealt) - len(expected)  # the last round is filled with the epoch's first batches
        ok = Counter(dealt) == Counter(expected + expected[:padding])
        counts = ", ".join(f"rank {r} {len(rank_batches[epoch])}" for r, rank_batches in enumerate(per_rank))
        note = f" (+{padding} padding)" if padding else ""
        verdict = "yes" if ok else "NO"
        print(f"  epoch {epoch}: {counts} of {len(expected)} batches{note}; disjoint and complete: {verdict}")
        if not ok:
            raise SystemExit("the ranks did not partition the sampler's batches")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    pl.seed_everything(7, verbose=False)
    train, val = Digits(train=True), Digits(train=False)
    sampler = ClassBalancedBatches(train.labels.tolist(), p=8, k=8, seed=1)
    model = Embedder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_custom_sampler",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(train, batch_sampler=sampler), DataLoader(val, batch_size=128))
    if trainer.global_rank == 0:
        check_partition(model.report["per_rank"], sampler)  # type: ignore[arg-type]
        recalls = model.report["recalls"]
        print(f"\nvalidation recall@1 on {len(val)} digits gathered from both ranks:")
        print(f"  after epoch 0: {recalls[0]:.3f}; after epoch {len(recalls) - 1}: {recalls[-1]:.3f}")  # type: ignore


if __name__ == "__main__":
    main()
