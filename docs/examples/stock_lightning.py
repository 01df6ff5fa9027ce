"""What stock Lightning DDP does with three kinds of custom sampler, next to this package's strategy.

Each case trains one epoch on 2 CPU processes over 48 items and records, per rank, the dataset indices of
every batch. The script prints one line per case and asserts what the page "Why custom batch samplers break
in DDP" says. Run it: ``python docs/examples/stock_lightning.py`` (under a minute on 2 cores).

The fork launcher keeps the runs quick. The unseeded sampler draws fresh operating-system entropy in
``__iter__`` (``numpy.random.default_rng()``), so its ranks disagree under every launcher. A sampler that
uses the global torch, NumPy or Python generators without seeding them is less predictable: Lightning's
fork and spawn launchers hand every rank the main process's generator states, so its ranks agree by
accident, while under the popen launcher (plain ``strategy="ddp"``) every rank is a fresh process with
its own seed, and they disagree.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler, SequentialSampler

import lightning_ddp_ext  # noqa: F401  (registers "ddp_custom_sampler_fork")

SIZE = 48


class Items(Dataset):
    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.ones(1), index


class ClassBalanced:
    """P classes x K items per batch; a plain class: no BatchSampler base, no `sampler`, no `batch_size`."""

    def __init__(self, labels: List[int], p: int, k: int, seed: int = 0) -> None:
        self.p, self.k, self.seed, self.epoch = p, k, seed, 0
        self.by_class: Dict[int, List[int]] = {}
        for index, label in enumerate(labels):
            self.by_class.setdefault(label, []).append(index)
        self.batches = len(labels) // (p * k)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[List[int]]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        classes = sorted(self.by_class)
        for _ in range(self.batches):
            batch: List[int] = []
            for c in torch.randperm(len(classes), generator=generator)[: self.p].tolist():
                members = self.by_class[classes[c]]
                batch += [members[i] for i in torch.randperm(len(members), generator=generator)[: self.k].tolist()]
            yield batch


class NewestFirst(BatchSampler):
    """BatchSampler's constructor, but it builds its batches itself and never reads `self.sampler`."""

    def __iter__(self) -> Iterator[List[int]]:
        for start in reversed(range(0, SIZE, self.batch_size)):
            yield list(range(start, start + self.batch_size))

    def __len__(self) -> int:
        return SIZE // self.batch_size


class UnseededShuffle(Sampler[int]):
    """A custom index sampler that shuffles with a generator it never seeds."""

    def __iter__(self) -> Iterator[int]:
        return iter(np.random.default_rng().permutation(SIZE).tolist())

    def __len__(self) -> int:
        return SIZE


class Recorder(pl.LightningModule):
    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.out_dir = out_dir
        self.batches: List[List[int]] = []

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, index = batch
        self.batches.append(index.tolist())
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(self.batches))


def loader(case: str) -> DataLoader:
    if case == "plain class":
        return DataLoader(Items(), batch_sampler=ClassBalanced([i % 6 for i in range(SIZE)], p=2, k=4))
    if case == "BatchSampler subclass":
        return DataLoader(Items(), batch_sampler=NewestFirst(SequentialSampler(range(SIZE)), 8, False))
    return DataLoader(Items(), batch_size=8, sampler=UnseededShuffle())


def run(case: str, strategy: str) -> str:
    """Train one epoch; return what happened, in a few words."""
    single_process = [list(batch) for batch in loader(case).batch_sampler]  # the sequence of one process
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        try:
            trainer.fit(Recorder(out_dir), loader(case))
        except Exception as error:  # noqa: BLE001 (the launcher re-raises a rank's error in its own type)
            if "can't inject a (distributed) sampler" in str(error):
                return "crash: Lightning can't inject a (distributed) sampler into your batch sampler"
            if "does not produce the same sequence on every rank" in str(error):
                return "RuntimeError before the first optimizer step: seed the sampler identically on every rank"
            raise
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(2)]
    if ranks[0] == ranks[1]:
        return f"both ranks trained on the same {len(ranks[0])} batches"
    if case == "unseeded index sampler":  # no single sequence to compare with: count what was never seen
        seen = {i for batches in ranks for batch in batches for i in batch}
        return f"shares overlap: {SIZE - len(seen)} of {SIZE} items never seen" if len(seen) < SIZE else "all seen"
    if ranks[0] == single_process[0::2] and ranks[1] == single_process[1::2]:
        return f"dealt: rank 0 got batches 0, 2, 4 and rank 1 got 1, 3, 5 of the sampler's {len(single_process)}"
    return "neither identical nor dealt"


def main() -> int:
    outcomes = {}
    cases = [
        ("plain class", "ddp_fork"),
        ("plain class", "ddp_custom_sampler_fork"),
        ("BatchSampler subclass", "ddp_fork"),
        ("BatchSampler subclass", "ddp_custom_sampler_fork"),
        ("unseeded index sampler", "ddp_fork"),
        ("unseeded index sampler", "ddp_custom_sampler_fork"),
    ]
    for case, strategy in cases:
        outcomes[case, strategy] = run(case, strategy)
        print(f"{case:<24} {strategy:<24} {outcomes[case, strategy]}", flush=True)
    assert outcomes["plain class", "ddp_fork"].startswith("crash")
    assert outcomes["BatchSampler subclass", "ddp_fork"].startswith("both ranks trained on the same")
    assert outcomes["unseeded index sampler", "ddp_fork"].startswith("shares overlap")
    for case in ("plain class", "BatchSampler subclass"):
        assert outcomes[case, "ddp_custom_sampler_fork"].startswith("dealt"), outcomes[case, "ddp_custom_sampler_fork"]
    assert outcomes["unseeded index sampler", "ddp_custom_sampler_fork"].startswith("RuntimeError")
    return 0


if __name__ == "__main__":
    sys.exit(main())
