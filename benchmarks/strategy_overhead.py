"""Step-time overhead of "ddp_custom_sampler" against Lightning's "ddp", and all-reduce rounds per step.

1. Two jobs on 2 CPU processes. For each job one process tree runs ``--repeats`` pairs of fits, one fit per
   strategy in a pair, back to back in the same two processes (alternating which runs first), so process
   start-up stays out and machine drift hits both members of a pair alike. Each rank is pinned to a core of
   its own when there are enough. A fit reports rank 0's median time per batch, from one
   ``on_train_batch_end`` to the next (the first from the epoch's start), so fetching the batch (the sampler,
   collation) counts as well as the step; its first epoch is warm-up.

   - ``plain``: a plain ``BatchSampler``, which stock Lightning supports, under "ddp" and "ddp_custom_sampler".
     Target: the median of the pairs' ratios <= 1.02. The verdict uses the median's 95 % interval (order
     statistics of the pairs' ratios): PASS when all of it is at or below the target, FAIL when all of it is
     above, "not resolved" otherwise (more ``--repeats``, or a quieter machine, narrow it;
     ``strategy_instructions.py`` counts the same overhead in instructions, which repeat).
   - ``custom``: a batch sampler that subclasses nothing (shuffled per epoch), dealt by "ddp_custom_sampler"
     against stock "ddp" with ``use_distributed_sampler=False`` and the user dealing by hand (every W-th
     batch), as users do today. Shown, no target.
2. Gradient all-reduce rounds per optimizer step under "ddp_custom_sampler" for accumulate_grad_batches
   1, 2, 4, 8, counted by a DDP comm hook (one count per round: the hook's last bucket). Target: exactly 1.

Run: ``python benchmarks/strategy_overhead.py`` (about a minute on 2 cores; ``--repeats 30`` for a narrower
interval).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _processes import run_process_tree  # noqa: E402

ACCUMULATIONS = (1, 2, 4, 8)
TARGET_RATIO = 1.02
SAMPLES, BATCH = 4096, 32
CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []  # before any pinning
# (job, baseline strategy, our strategy): "ddp" in the custom job deals by hand (use_distributed_sampler=False).
JOBS: Tuple[Tuple[str, str, str], ...] = (
    ("plain", "ddp", "ddp_custom_sampler"),
    ("custom", "ddp", "ddp_custom_sampler"),
)


class ShuffledBatches:
    """The custom job's batch sampler: subclasses nothing; a fresh order every epoch (seed + epoch)."""

    def __init__(self, size: int, batch: int, seed: int = 0) -> None:
        self.size, self.batch, self.seed, self.epoch = size, batch, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size // self.batch

    def __iter__(self) -> Iterator[List[int]]:
        order = list(range(self.size))
        random.Random(self.seed + self.epoch).shuffle(order)
        for start in range(0, len(self) * self.batch, self.batch):
            yield order[start : start + self.batch]


class DealtByHand:
    """What a user writes today for stock "ddp": this rank's every W-th batch, the same count on every rank."""

    def __init__(self, sampler: ShuffledBatches, rank: int, world: int) -> None:
        self.sampler, self.rank, self.world = sampler, rank, world

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler) // self.world

    def __iter__(self) -> Iterator[List[int]]:
        for position, batch in enumerate(self.sampler):
            if position >= len(self) * self.world:
                return
            if position % self.world == self.rank:
                yield batch


def _pin_to_own_core(local_rank: int, ranks: int) -> None:
    """Keep each rank on a core of its own when the machine has one for each (less scheduling noise)."""
    if len(CORES) >= ranks:
        os.sched_setaffinity(0, {CORES[local_rank]})


def median_interval(values: List[float], confidence: float = 0.95) -> Tuple[float, float]:
    """Distribution-free interval for the median of ``values``: the k-th smallest and k-th largest, k the
    largest rank whose binomial tail stays within (1 - confidence) / 2; the whole range when there are too
    few values for that (fewer than 6 at 95 %)."""
    ordered, n = sorted(values), len(values)
    tail, k = 0.0, 0
    while True:
        tail += math.comb(n, k) / 2**n  # P(at most k of the n values fall below the true median)
        if tail > (1 - confidence) / 2 or k >= n // 2:
            break
        k += 1
    return (ordered[0], ordered[-1]) if k == 0 else (ordered[k - 1], ordered[n - k])


def _fit(job: str, strategy: str, accumulate: int, epochs: int, callbacks: Sequence[Any] = ()) -> Dict[str, Any]:
    """One ``Trainer.fit`` of ``job`` under ``strategy`` (with extra Lightning ``callbacks``); rank 0's median
    time per batch, rounds and steps."""
    import lightning.pytorch as pl
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ddp_ext import CustomDDP

    rounds = [0]

    def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]
        if bucket.is_last():
            rounds[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(SAMPLES, 64), torch.randint(0, 10, (SAMPLES,)))

    class Timed(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
            self.batch_times: List[float] = []
            self._last = 0.0

        def train_dataloader(self) -> DataLoader:
            if job == "plain":
                return DataLoader(data, batch_size=BATCH)  # a plain BatchSampler over a SequentialSampler
            sampler: Any = ShuffledBatches(SAMPLES, BATCH)
            if strategy == "ddp":
                sampler = DealtByHand(sampler, self.trainer.global_rank, self.trainer.world_size)
            return DataLoader(data, batch_sampler=sampler)

        def setup(self, stage: str) -> None:
            _pin_to_own_core(self.trainer.local_rank, self.trainer.num_devices)

        def on_train_epoch_start(self) -> None:
            self._last = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            now = time.perf_counter()
            if self.current_epoch > 0:  # the first epoch is warm-up
                self.batch_times.append(now - self._last)
            self._last = now

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    chosen: Any = strategy
    if strategy == "ddp_custom_sampler" and accumulate > 0:
        chosen = CustomDDP(ddp_comm_hook=counting_allreduce)
    model = Timed()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=chosen,
        max_epochs=epochs,
        accumulate_grad_batches=max(accumulate, 1),
        use_distributed_sampler=not (job == "custom" and strategy == "ddp"),
        logger=False,
        callbacks=list(callbacks),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    return {
        "rank": trainer.global_rank,
        "median_batch_s": statistics.median(model.batch_times) if model.batch_times else None,
        "rounds": rounds[0],
        "optimizer_steps": trainer.global_step,
    }


def _worker(task: str, repeats: int, epochs: int, out: str) -> None:
    """Every fit of one task in this process tree (Lightning's popen launcher re-runs this branch for rank 1;
    later fits reuse the two processes and their process group). ``task`` is a job name (timed pairs) or
    ``rounds`` (one fit per accumulation)."""
    results: List[Dict[str, Any]] = []
    if task == "rounds":
        for accumulate in ACCUMULATIONS:
            results.append(dict(_fit("plain", "ddp_custom_sampler", accumulate, 1), accumulate=accumulate))
    else:
        _, baseline, ours = next(job for job in JOBS if job[0] == task)
        for repeat in range(repeats):
            pair = (baseline, ours) if repeat % 2 == 0 else (ours, baseline)  # neither always runs first
            for strategy in pair:  # back to back in the same processes, so drift hits both alike
                results.append(dict(_fit(task, strategy, 0, epochs), strategy=strategy, pair=repeat))
    from lightning_ddp_ext import _exit

    # Stock "ddp" leaves its group to exit, where Gloo's threads can abort the process: the package's clean-up
    # destroys it (after letting Gloo's threads settle on torch < 2.8).
    _exit.destroy_process_group()
    if results and results[0]["rank"] == 0:
        Path(out).write_text(json.dumps(results))


def _run(task: str, repeats: int, epochs: int) -> List[Dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        command = [sys.executable, __file__, "--worker", task, str(repeats), str(epochs), out]
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE", "RANK")}
        status, _ = run_process_tree(command, timeout=1800, cwd=tmp, env=env)
        if status != 0:
            raise RuntimeError(f"the {task!r} runs exited with status {status}: rerun {command}")
        return json.loads(Path(out).read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description="CustomDDP step-time overhead and all-reduce rounds per step.")
    parser.add_argument("--repeats", type=int, default=10, help="pairs of fits per job, interleaved")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per fit, at least 2 (the first is warm-up)")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the first epoch is warm-up and is not timed")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    print("job     strategy                         median time per batch (ms), per fit")
    ratios: Dict[str, List[float]] = {}
    for job, baseline, ours in JOBS:
        fits = _run(job, args.repeats, args.epochs)
        medians = {s: [f["median_batch_s"] for f in fits if f["strategy"] == s] for s in (baseline, ours)}
        for strategy in (baseline, ours):
            label = strategy + (" (dealt by hand)" if job == "custom" and strategy == "ddp" else "")
            print(f"{job:7} {label:32} " + " ".join(f"{t * 1e3:6.3f}" for t in medians[strategy]))
        ratios[job] = [b / a for a, b in zip(medians[baseline], medians[ours])]
    print(f"\nmedian of the {args.repeats} pairs' ratios (ddp_custom_sampler / ddp), with its 95 % interval:")
    low, high = median_interval(ratios["plain"])
    verdict = (
        "PASS" if high <= TARGET_RATIO
        else "FAIL" if low > TARGET_RATIO
        else "not resolved (more --repeats, or count it: strategy_instructions.py)"
    )
    print(f"plain job (a BatchSampler):          {statistics.median(ratios['plain']):.3f}"
          f" [{low:.3f}, {high:.3f}]   target <= {TARGET_RATIO}: {verdict}")
    low, high = median_interval(ratios["custom"])
    print(f"custom job (against dealing by hand): {statistics.median(ratios['custom']):.3f}"
          f" [{low:.3f}, {high:.3f}]   (no target)\n")

    print("accumulate_grad_batches   optimizer steps   all-reduce rounds   rounds per step")
    exact = True
    for result in _run("rounds", 1, 1):
        per_step = result["rounds"] / result["optimizer_steps"]
        exact = exact and per_step == 1
        steps, rounds = result["optimizer_steps"], result["rounds"]
        print(f"{result['accumulate']:23d}   {steps:15d}   {rounds:17d}   {per_step:15.3f}")
    print(f"target exactly 1 round per optimizer step: {'PASS' if exact else 'FAIL'}")


if __name__ == "__main__":
    main()
