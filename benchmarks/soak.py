"""Soak: many short epochs on 2 CPU processes with a shuffling custom batch sampler, watching for leaks.

    python benchmarks/soak.py                 # 200 epochs (the default), strategy="ddp_custom_sampler"
    python benchmarks/soak.py --epochs 50 --workers 2 --persistent-workers --json soak.json

Every epoch, on every rank: resident memory (after ``gc.collect()``), threads and open file descriptors, read
from ``/proc/self``; and the partition check: the batches all ranks trained on, gathered on rank 0, must be
exactly the user's sequence for that epoch (plus the padding repeats), with the same count on every rank.
Rank 0 prints a row every ``--every`` epochs and a summary against the targets:

* RSS growth <= 5 % from epoch 10 to the end, on every rank;
* threads and file descriptors at the end no more than at epoch 10 (no leak);
* the partition held in every epoch.

The popen launcher re-runs this file for rank 1 with the same arguments. Exit status 1 when a target is missed.
A rank still running after ``--timeout`` seconds prints its stacks and exits. Linux only (``/proc``).
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from lightning_ddp_ext import CustomDDP

WARMUP_EPOCH = 10
RSS_GROWTH_LIMIT = 0.05


class ShuffledVariableBatches:
    """A custom batch sampler (subclasses nothing): a fresh permutation every epoch, seeded by seed + epoch,
    cut into batches whose sizes cycle through ``sizes`` (variable-size batches, as token budgets make)."""

    def __init__(self, size: int, sizes: tuple[int, ...] = (3, 5, 8), seed: int = 0) -> None:
        self.size, self.sizes, self.seed, self.epoch = size, sizes, seed, 0
        self._count = 0
        taken = 0
        while taken < size:
            taken += self.sizes[self._count % len(self.sizes)]
            self._count += 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[List[int]]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        start = 0
        for k in range(self._count):
            end = start + self.sizes[k % len(self.sizes)]
            yield order[start:end]
            start = end


class Indexed(Dataset):
    def __init__(self, size: int) -> None:
        self.features = torch.linspace(-1, 1, size).unsqueeze(1)

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.features[index], index


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


class Soaked(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.batches: List[tuple[int, ...]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, indices = batch
        self.batches.append(tuple(indices.tolist()))
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Monitor(pl.Callback):
    """Per-epoch figures on every rank, gathered and checked on rank 0."""

    def __init__(self, sampler: ShuffledVariableBatches, world: int, every: int) -> None:
        self.reference = ShuffledVariableBatches(sampler.size, sampler.sizes, sampler.seed)  # rank 0's own copy
        self.world, self.every = world, every
        self.rows: List[Dict[str, Any]] = []
        self.started = time.perf_counter()

    def expected(self, epoch: int) -> Counter:
        self.reference.set_epoch(epoch)
        sequence = [tuple(b) for b in self.reference]
        padding = -len(sequence) % self.world
        return Counter(sequence + sequence[:padding])

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Soaked) -> None:
        gc.collect()
        mine = {"rss": rss_bytes(), "threads": thread_count(), "fds": fd_count(), "batches": pl_module.batches}
        pl_module.batches = []
        gathered: List[Optional[Dict[str, Any]]] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if trainer.global_rank != 0:
            return
        epoch = trainer.current_epoch
        counts = [len(g["batches"]) for g in gathered]  # type: ignore[index]
        seen = Counter(b for g in gathered for b in g["batches"])  # type: ignore[index]
        row = {
            "epoch": epoch,
            "rss_mb": [round(g["rss"] / 2**20, 2) for g in gathered],  # type: ignore[index]
            "threads": [g["threads"] for g in gathered],  # type: ignore[index]
            "fds": [g["fds"] for g in gathered],  # type: ignore[index]
            "batches_per_rank": counts,
            "partition_ok": len(set(counts)) == 1 and seen == self.expected(epoch),
            "elapsed_s": round(time.perf_counter() - self.started, 1),
        }
        self.rows.append(row)
        if epoch % self.every == 0 or epoch == trainer.max_epochs - 1 or not row["partition_ok"]:
            print(
                f"epoch {epoch:4d}  rss MB {row['rss_mb']}  threads {row['threads']}  fds {row['fds']}"
                f"  batches/rank {counts}  partition {'ok' if row['partition_ok'] else 'BROKEN'}"
                f"  t={row['elapsed_s']}s",
                flush=True,
            )


def summarise(rows: List[Dict[str, Any]], world: int) -> Dict[str, Any]:
    base = next(r for r in rows if r["epoch"] == min(WARMUP_EPOCH, rows[-1]["epoch"]))
    last = rows[-1]
    after = [r for r in rows if r["epoch"] >= base["epoch"]]
    growth = [(last["rss_mb"][k] - base["rss_mb"][k]) / base["rss_mb"][k] for k in range(world)]
    summary = {
        "epochs": len(rows),
        "from_epoch": base["epoch"],
        "rss_mb_from": base["rss_mb"],
        "rss_mb_end": last["rss_mb"],
        "rss_mb_max": [max(r["rss_mb"][k] for r in after) for k in range(world)],
        "rss_growth_pct": [round(100 * g, 2) for g in growth],
        "threads_from": base["threads"],
        "threads_end": last["threads"],
        "threads_max": [max(r["threads"][k] for r in after) for k in range(world)],
        "fds_from": base["fds"],
        "fds_end": last["fds"],
        "fds_max": [max(r["fds"][k] for r in after) for k in range(world)],
        "partition_broken_epochs": [r["epoch"] for r in rows if not r["partition_ok"]],
        "seconds": last["elapsed_s"],
    }
    rss_target = f"rss growth <= {100 * RSS_GROWTH_LIMIT:.0f}% from epoch {base['epoch']}"
    summary["targets"] = {
        rss_target: all(g <= RSS_GROWTH_LIMIT for g in growth),
        "no leaked threads": all(last["threads"][k] <= base["threads"][k] for k in range(world)),
        "no leaked file descriptors": all(last["fds"][k] <= base["fds"][k] for k in range(world)),
        "partition held every epoch": not summary["partition_broken_epochs"],
    }
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument(
        "--samples", type=int, default=201,
        help="dataset size (the default makes 39 batches: one padding repeat on 2 ranks)",
    )
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    parser.add_argument(
        "--persistent-workers",
        action="store_true",
        help="keep the workers between epochs (else each epoch forks new ones; on Python < 3.12 a fork from a"
        " threaded process can deadlock in the child, CPython issue 112275)",
    )
    parser.add_argument("--shuffle-window", type=int, default=None, help="CustomDDP shuffle_window (None: full)")
    parser.add_argument("--every", type=int, default=10, help="print a row every N epochs")
    parser.add_argument("--json", default=None, help="write the rows and the summary here")
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds after which every rank prints its stacks and exits"
    )
    args = parser.parse_args()
    # A hang outside a collective (which the strategy's 60 s timeout ends) must not run forever: each rank
    # (the launcher re-runs this file for rank 1) dumps its threads' stacks and exits with status 1.
    faulthandler.dump_traceback_later(args.timeout, exit=True)

    sampler = ShuffledVariableBatches(args.samples, seed=3)
    loader = DataLoader(
        Indexed(args.samples),
        batch_sampler=sampler,
        num_workers=args.workers,
        persistent_workers=args.persistent_workers and args.workers > 0,
    )
    monitor = Monitor(sampler, args.devices, args.every)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=CustomDDP(
            start_method="popen",
            shuffle_batches_between_ranks=True,
            shuffle_window=args.shuffle_window,
            timeout=timedelta(seconds=60),
        ),
        max_epochs=args.epochs,
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    if trainer.global_rank == 0:
        print(
            f"soak: {args.epochs} epochs, {args.devices} processes, {len(sampler)} variable-size batches per epoch,"
            f" shuffle_window={args.shuffle_window}, workers={args.workers}"
            f"{' (persistent)' if args.persistent_workers else ''}, python {sys.version.split()[0]},"
            f" torch {torch.__version__}, lightning {pl.__version__}, {threading.active_count()} python thread(s)",
            flush=True,
        )
    trainer.fit(Soaked(), loader)
    if trainer.global_rank != 0:
        return 0
    summary = summarise(monitor.rows, args.devices)
    print("\nsummary (per rank):")
    for key, value in summary.items():
        if key != "targets":
            print(f"  {key:24s} {value}")
    print("targets:")
    for name, met in summary["targets"].items():
        print(f"  [{'ok' if met else 'MISSED'}] {name}")
    if args.json:
        with open(args.json, "w") as sink:
            json.dump({"args": vars(args), "rows": monitor.rows, "summary": summary}, sink, indent=1)
    return 0 if all(summary["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
