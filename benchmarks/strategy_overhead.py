"""Step-time overhead of "ddp_custom_sampler" against Lightning's "ddp", and all-reduce rounds per step.

1. The same job (a plain ``BatchSampler``, which stock Lightning supports) under "ddp" and
   "ddp_custom_sampler" on 2 CPU processes, run alternately ``--repeats`` times each; each run reports its
   median step time (first epoch skipped as warm-up); the ratio is the median over the back-to-back pairs.
   Target: ratio <= 1.02.
2. Gradient all-reduce rounds per optimizer step under "ddp_custom_sampler" for accumulate_grad_batches
   1, 2, 4, 8, counted by a DDP comm hook (one count per round: the hook's last bucket). Target: exactly 1.

Run: ``python benchmarks/strategy_overhead.py`` (``--repeats 3`` for a quicker, noisier look).
Each run is a separate ``python`` process tree, as a user's training script would be.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

ACCUMULATIONS = (1, 2, 4, 8)
TARGET_RATIO = 1.02


def _worker(strategy: str, accumulate: int, out: str, epochs: int) -> None:
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

    class Timed(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
            self.step_times: List[float] = []
            self._started = 0.0

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self._started = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.current_epoch > 0:  # the first epoch is warm-up
                self.step_times.append(time.perf_counter() - self._started)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
    loader = DataLoader(data, batch_size=32)  # a plain BatchSampler over a SequentialSampler
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
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    import torch.distributed as dist

    if dist.is_initialized():  # stock "ddp" leaves its group to exit, where gloo's threads can abort the process
        dist.destroy_process_group()
    if trainer.global_rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "median_step_s": statistics.median(model.step_times) if model.step_times else None,
                    "rounds": rounds[0],
                    "optimizer_steps": trainer.global_step,
                }
            )
        )


def _run(strategy: str, accumulate: int, epochs: int) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        command = [sys.executable, __file__, "--worker", strategy, str(accumulate), out, str(epochs)]
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE", "RANK")}
        subprocess.run(command, check=True, timeout=600, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(Path(out).read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description="CustomDDP step-time overhead and all-reduce rounds per step.")
    parser.add_argument("--repeats", type=int, default=5, help="runs per strategy, interleaved")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run, at least 2 (the first is warm-up)")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the first epoch is warm-up and is not timed")

    medians: Dict[str, List[float]] = {"ddp": [], "ddp_custom_sampler": []}
    for repeat in range(args.repeats):
        for strategy in medians:  # interleaved, so drift in machine load hits both alike
            result = _run(strategy, 0, args.epochs)
            medians[strategy].append(result["median_step_s"])
            print(f"run {repeat + 1}/{args.repeats} {strategy:>20}: median step {result['median_step_s'] * 1e3:.3f} ms", flush=True)
    ddp, ours = (statistics.median(medians[name]) for name in ("ddp", "ddp_custom_sampler"))
    # Each pair of runs was measured back to back, so the median of per-pair ratios cancels load drift.
    ratio = statistics.median(b / a for a, b in zip(medians["ddp"], medians["ddp_custom_sampler"]))
    print("\nstrategy              median step (ms)")
    print(f"ddp                   {ddp * 1e3:16.3f}")
    print(f"ddp_custom_sampler    {ours * 1e3:16.3f}")
    print(f"median of the {args.repeats} interleaved pairs' ratios (custom / ddp): {ratio:.3f}")
    print(f"target ratio <= {TARGET_RATIO}: {'PASS' if ratio <= TARGET_RATIO else 'FAIL'}\n")

    print("accumulate_grad_batches   optimizer steps   all-reduce rounds   rounds per step")
    exact = True
    for accumulate in ACCUMULATIONS:
        result = _run("ddp_custom_sampler", accumulate, 1)
        per_step = result["rounds"] / result["optimizer_steps"]
        exact = exact and per_step == 1
        print(f"{accumulate:23d}   {result['optimizer_steps']:15d}   {result['rounds']:17d}   {per_step:15.3f}")
    print(f"target exactly 1 round per optimizer step: {'PASS' if exact else 'FAIL'}")


if __name__ == "__main__":
    main()
