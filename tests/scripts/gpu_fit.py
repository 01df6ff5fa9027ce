"""Fit on one CUDA device with CustomDDP (NCCL), or with CustomDDPSharded: the GPU paths, for tests/test_gpu.py.

Usage: python gpu_fit.py OUT_DIR ddp|sharded

One process (devices=1), so a single GPU suffices: NCCL refuses two ranks on one device. What the run used
(backend, wrapper, its device ids, where the parameters live, the sampler and the optimizer) is written to
OUT_DIR/gpu_facts.json, and what each rank trained on to OUT_DIR/rank0.json (see scenarios.Recorder).
"""
import json
import sys
from pathlib import Path
from typing import Any, Dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `scenarios`

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from scenarios import CountingDDP, IndexDataset, PKBatches, Recorder, labels_for, trainer_kwargs  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


class GpuFacts(pl.Callback):
    """Records, when training starts and ends, what the strategy set up on the device."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.facts: Dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        wrapped = trainer.strategy.model
        self.facts.update(
            backend=dist.get_backend(),
            world_size=dist.get_world_size(),
            wrapper=type(wrapped).__name__,
            device_ids=getattr(wrapped, "device_ids", None),
            parameter_devices=sorted({str(p.device) for p in pl_module.parameters()}),
            batch_sampler=type(trainer.train_dataloader.batch_sampler).__name__,
            optimizer=type(trainer.optimizers[0]).__name__,
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.facts["global_step"] = trainer.global_step
        self.path.write_text(json.dumps(self.facts))


if __name__ == "__main__":
    out, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "ddp":
        strategy: Any = CountingDDP()
    else:
        from lightning_ddp_ext.sharded import CustomDDPSharded

        strategy = CustomDDPSharded()
    loader = DataLoader(IndexDataset(), batch_sampler=PKBatches(labels_for(), p=2, k=4, seed=1))
    trainer = pl.Trainer(
        strategy=strategy,
        callbacks=[GpuFacts(out / "gpu_facts.json")],
        **trainer_kwargs(accelerator="gpu", devices=1, max_epochs=2, accumulate_grad_batches=2),
    )
    trainer.fit(Recorder(str(out)), loader)
