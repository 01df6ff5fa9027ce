"""Step-time overhead of "ddp_custom_sampler" against Lightning's "ddp", and all-reduce rounds per step.

1. Two jobs on 2 CPU processes, each run ``--repeats`` times per strategy, alternately (and alternating which
   of a pair runs first); a run reports its median time per batch, from one ``on_train_batch_end`` to the next
   (the first from the epoch's start), so fetching the batch (the sampler, collation) counts as well as the
   step; the first epoch is warm-up. Ratios are medians over the back-to-back pairs.

   - ``plain``: a plain ``BatchSampler``, which stock Lightning supports, under "ddp" and "ddp_custom_sampler".
     Target: ratio <= 1.02.
   - ``custom``: a batch sampler that subclasses nothing (shuffled per epoch), dealt by "ddp_custom_sampler"
     against stock "ddp" with ``use_distributed_sampler=False`` and the user dealing by hand (every W-th
     batch), as users do today. Shown, no target.
2. Gradient all-reduce rounds per optimizer step under "ddp_custom_sampler" for accumulate_grad_batches
   1, 2, 4, 8, counted by a DDP comm hook (one count per round: the hook's last bucket). Target: exactly 1.

Run: ``python benchmarks/strategy_overhead.py`` (``--repeats 3`` for a quicker, noisier look).
Each run is a separate ``python`` process tree, as a user's training script would be.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _processes import run_process_tree  # noqa: E402

ACCUMULATIONS = (1, 2, 4, 8)
TARGET_RATIO = 1.02
SAMPLES, BATCH = 4096, 32
# (job, baseline strategy, our strategy): "ddp" in the custom job deals by hand (use_distributed_sampler=False).
JOBS: Tuple[Tuple[str, str, str], ...] = (("plain", "ddp", "ddp_custom_sampler"), ("custom", "ddp", "ddp_custom_sampler"))


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


def _worker(job: str, strategy: str, accumulate: int, out: str, epochs: int) -> None:
    """One training run (this branch is also what Lightning's popen launcher re-runs for rank 1)."""
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
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    import torch.distributed as dist

    if dist.is_initialized():  # stock "ddp" leaves its group to exit, where gloo's threads can abort the process
        dist.destroy_process_group()
    if trainer.global_rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "median_batch_s": statistics.median(model.batch_times) if model.batch_times else None,
                    "rounds": rounds[0],
                    "optimizer_steps": trainer.global_step,
                }
            )
        )


def _run(job: str, strategy: str, accumulate: int, epochs: int) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        command = [sys.executable, __file__, "--worker", job, strategy, str(accumulate), out, str(epochs)]
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE", "RANK")}
        status, _ = run_process_tree(command, timeout=600, cwd=tmp, env=env)
        if status != 0:
            raise RuntimeError(f"the {job} job under {strategy!r} exited with status {status}: rerun {command}")
        return json.loads(Path(out).read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
        return
    parser = argparse.ArgumentParser(description="CustomDDP step-time overhead and all-reduce rounds per step.")
    parser.add_argument("--repeats", type=int, default=5, help="runs per strategy and job, interleaved")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run, at least 2 (the first is warm-up)")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the first epoch is warm-up and is not timed")

    print("job     strategy                         median time per batch (ms), per run")
    ratios: Dict[str, float] = {}
    for job, baseline, ours in JOBS:
        medians: Dict[str, List[float]] = {baseline: [], ours: []}
        for repeat in range(args.repeats):
            pair = (baseline, ours) if repeat % 2 == 0 else (ours, baseline)  # neither always runs first
            for strategy in pair:  # back to back, so drift in machine load hits both alike
                medians[strategy].append(_run(job, strategy, 0, args.epochs)["median_batch_s"])
        for strategy in (baseline, ours):
            label = strategy + (" (dealt by hand)" if job == "custom" and strategy == "ddp" else "")
            print(f"{job:7} {label:32} " + " ".join(f"{t * 1e3:6.3f}" for t in medians[strategy]))
        ratios[job] = statistics.median(b / a for a, b in zip(medians[baseline], medians[ours]))
    print(f"\nmedian of the {args.repeats} interleaved pairs' ratios (ddp_custom_sampler / ddp):")
    print(f"plain job (a BatchSampler):          {ratios['plain']:.3f}   target <= {TARGET_RATIO}:"
          f" {'PASS' if ratios['plain'] <= TARGET_RATIO else 'FAIL'}")
    print(f"custom job (against dealing by hand): {ratios['custom']:.3f}   (no target)\n")

    print("accumulate_grad_batches   optimizer steps   all-reduce rounds   rounds per step")
    exact = True
    for accumulate in ACCUMULATIONS:
        result = _run("plain", "ddp_custom_sampler", accumulate, 1)
        per_step = result["rounds"] / result["optimizer_steps"]
        exact = exact and per_step == 1
        print(f"{accumulate:23d}   {result['optimizer_steps']:15d}   {result['rounds']:17d}   {per_step:15.3f}")
    print(f"target exactly 1 round per optimizer step: {'PASS' if exact else 'FAIL'}")


if __name__ == "__main__":
    main()
