"""Per-rank optimizer state, peak RSS and step time of "ddp_custom_sampler_sharded" against "ddp_custom_sampler".

Adam on two ~20M-parameter models, 2 CPU processes (gloo):

- ``mlp``: 8 evenly sized Linear(1600, 1600) layers;
- ``transformer``: a 8,000-token embedding, 4 encoder layers of width 512 and an output layer: large tensors
  first and last and mixed sizes between, where fairscale's in-order partition gives one rank 1.19x its share.

For each model, runs alternate between the two strategies (``--repeats`` each, so drift in machine load hits
both alike); each run is a separate ``python`` process tree, as a user's training script would be. A run
reports, per rank: the bytes of optimizer state it holds, a fingerprint of the trained parameters (which must
agree across ranks, runs and strategies), its peak RSS, its share of the parameters (for the
sharded strategy), and its median step time (``--warmup`` steps skipped). Ratios are medians over the
interleaved pairs. Targets on 2 ranks: optimizer state <= 0.51x (MLP) and <= 0.52x (transformer) of
CustomDDP's, step time <= 1.25x.

Run: ``python benchmarks/sharded_memory.py`` (``--quick`` for one short pair per model; ``--plot PATH`` also
draws the ratios with matplotlib).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _processes import run_process_tree  # noqa: E402

MODELS = ("mlp", "transformer")
STRATEGIES = ("ddp_custom_sampler", "ddp_custom_sampler_sharded")
STATE_TARGETS = {"mlp": 0.51, "transformer": 0.52}
STEP_TARGET = 1.25
FINGERPRINT_RTOL = 1e-5  # float32 reductions in another order differ in the last bits only
VOCAB, WIDTH, LAYERS, SEQUENCE = 8000, 512, 4, 32


def build_mlp(device: Optional[str] = None) -> nn.Module:
    """~20.5M parameters in 8 equal Linear layers."""
    return nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(1600, 1600, device=device), nn.ReLU())])


class TinyLM(nn.Module):
    """A small transformer language model (~20.8M parameters)."""

    def __init__(self, device: Optional[str] = None) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH, device=device)
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=8, dim_feedforward=4 * WIDTH, batch_first=True, device=device)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embedding(tokens)))


def build_transformer(device: Optional[str] = None) -> nn.Module:
    return TinyLM(device)


def _fingerprint(model: nn.Module) -> List[float]:
    """Sum and sum of squares of all parameters, in float64: equal (to rounding) when two runs trained alike."""
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    return [flat.sum().item(), flat.square().sum().item()]


def _check_same_training(model_name: str, runs: Dict[str, List[List[Dict[str, Any]]]]) -> None:
    """Every rank of every run must end with the same parameters: a benchmark of a wrong result is no benchmark."""
    reference = runs[STRATEGIES[0]][0][0]["trained"]
    for strategy, strategy_runs in runs.items():
        for run in strategy_runs:
            for rank, report in enumerate(run):
                for got, want in zip(report["trained"], reference):
                    if abs(got - want) > FINGERPRINT_RTOL * max(abs(want), 1.0):
                        raise RuntimeError(
                            f"{model_name}: rank {rank} of a {strategy} run ended with parameters"
                            f" {report['trained']} (sum, sum of squares), {STRATEGIES[0]}'s first run with"
                            f" {reference}: the strategies did not train alike"
                        )


def _worker(model_name: str, strategy: str, out: str, steps: int, warmup: int) -> None:
    """One training run on 2 ranks (this branch is also what Lightning's popen launcher re-runs for rank 1)."""
    import resource
    import time

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_ddp_ext  # noqa: F401  (registers the strategy names)

    class Job(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_mlp() if model_name == "mlp" else build_transformer()
            self.step_times: List[float] = []
            self._started = 0.0

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self._started = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx >= warmup:
                self.step_times.append(time.perf_counter() - self._started)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            if model_name == "mlp":
                return self.net(x).pow(2).mean()
            logits = self.net(x[:, :-1])
            return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def on_train_end(self) -> None:
            optimizer = self.trainer.optimizers[0]
            shard = getattr(optimizer, "optim", optimizer)  # OSS keeps this rank's state in its shard optimizer
            tensors = [t for state in shard.state.values() for t in state.values() if torch.is_tensor(t)]
            owned = sum(p.numel() for group in shard.param_groups for p in group["params"])
            report = {
                "state_bytes": sum(t.numel() * t.element_size() for t in tensors),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "owned_params": owned,
                "params": sum(p.numel() for p in self.parameters()),
                "median_step_s": statistics.median(self.step_times),
                "trained": _fingerprint(self.net),
            }
            Path(out, f"rank{self.global_rank}.json").write_text(json.dumps(report))

    pl.seed_everything(0, verbose=False)
    if model_name == "mlp":
        data = TensorDataset(torch.randn(2 * 16 * steps, 1600))
        loader = DataLoader(data, batch_size=16)
    else:
        data = TensorDataset(torch.randint(0, VOCAB, (2 * 2 * steps, SEQUENCE + 1)))
        loader = DataLoader(data, batch_size=2)
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
    trainer.fit(Job(), loader)


def _run(model_name: str, strategy: str, steps: int, warmup: int) -> List[Dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, __file__, "--worker", model_name, strategy, tmp, str(steps), str(warmup)]
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE", "RANK")}
        status, _ = run_process_tree(command, timeout=900, cwd=tmp, env=env)
        if status != 0:
            raise RuntimeError(f"the {model_name} run under {strategy!r} exited with status {status}: rerun {command}")
        return [json.loads(Path(tmp, f"rank{rank}.json").read_text()) for rank in range(2)]


def _plot(path: str, rows: List[Dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    labels = ["optimizer state / rank", "peak RSS / rank", "step time"]
    width = 0.35
    for offset, row in enumerate(rows):
        values = [row["state_ratio"], row["rss_ratio"], row["step_ratio"]]
        axis.bar([i + offset * width for i in range(3)], values, width, label=row["model"])
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xticks([i + width / 2 for i in range(3)], labels)
    axis.set_ylabel("sharded / CustomDDP")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
        return
    parser = argparse.ArgumentParser(description="Optimizer-state memory and step time of the sharded strategy.")
    parser.add_argument("--repeats", type=int, default=3, help="runs per strategy and model, interleaved")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of a run left out of its step time")
    parser.add_argument("--quick", action="store_true", help="one short run per strategy and model")
    parser.add_argument("--plot", metavar="PATH", help="also save a bar chart of the ratios (needs matplotlib)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 6, 2

    mib = 2**20
    rows = []
    print(f"{'model':12} {'params':>7} {'strategy':28} {'opt state/rank MiB':>18} {'peak RSS/rank MiB':>17}"
          f" {'step ms':>8} {'largest shard/ideal':>19}")
    for model_name in MODELS:
        runs: Dict[str, List[List[Dict[str, Any]]]] = {strategy: [] for strategy in STRATEGIES}
        for repeat in range(args.repeats):
            for strategy in STRATEGIES:
                runs[strategy].append(_run(model_name, strategy, args.steps, args.warmup))
        _check_same_training(model_name, runs)
        summary: Dict[str, Dict[str, float]] = {}
        for strategy in STRATEGIES:
            reports = [rank for run in runs[strategy] for rank in run]
            params = reports[0]["params"]
            summary[strategy] = {
                "state": max(r["state_bytes"] for r in reports),
                "rss": statistics.median(max(rank["peak_rss_bytes"] for rank in run) for run in runs[strategy]),
                "step": statistics.median(max(rank["median_step_s"] for rank in run) for run in runs[strategy]),
                "balance": max(r["owned_params"] for r in reports) / (params / 2),
            }
            s = summary[strategy]
            balance = f"{s['balance']:.3f}" if strategy.endswith("sharded") else "-"
            print(f"{model_name:12} {params / 1e6:6.1f}M {strategy:28} {s['state'] / mib:18.1f} {s['rss'] / mib:17.0f}"
                  f" {s['step'] * 1e3:8.0f} {balance:>19}")
        pairs = list(zip(runs[STRATEGIES[0]], runs[STRATEGIES[1]]))
        row = {
            "model": model_name,
            "state_ratio": summary[STRATEGIES[1]]["state"] / summary[STRATEGIES[0]]["state"],
            "rss_ratio": statistics.median(
                max(r["peak_rss_bytes"] for r in b) / max(r["peak_rss_bytes"] for r in a) for a, b in pairs
            ),
            "step_ratio": statistics.median(
                max(r["median_step_s"] for r in b) / max(r["median_step_s"] for r in a) for a, b in pairs
            ),
        }
        rows.append(row)

    print(f"\nsharded / CustomDDP, medians of {args.repeats} interleaved pair(s):")
    print(f"{'model':12} {'opt state/rank':>14} {'target':>7} {'peak RSS/rank':>13} {'step time':>9} {'target':>7}")
    for row in rows:
        state_target = STATE_TARGETS[row["model"]]
        state_ok = "PASS" if row["state_ratio"] <= state_target else "FAIL"
        step_ok = "PASS" if row["step_ratio"] <= STEP_TARGET else "FAIL"
        print(f"{row['model']:12} {row['state_ratio']:14.3f} {'<=' + str(state_target):>7} {row['rss_ratio']:13.3f}"
              f" {row['step_ratio']:9.3f} {'<=' + str(STEP_TARGET):>7}   state {state_ok}, step {step_ok}")
    if args.plot:
        _plot(args.plot, rows)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
