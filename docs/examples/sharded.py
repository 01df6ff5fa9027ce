"""The sharded variant on 2 CPU processes: optimizer state split across ranks, one consolidated checkpoint.

Trains a small MLP (tensors of similar sizes, so that they split evenly) with Adam under ``CustomDDPSharded``
(fairscale OSS + ShardedDataParallel), reports how many optimizer-state elements each rank holds, and checks
that the saved checkpoint holds the full optimizer state in the plain (unsharded) format. Needs fairscale
(``pip install "lightning_ddp_ext[sharded]"``). Run it: ``python docs/examples/sharded.py``.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_ext import CustomDDPSharded


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32),
        )

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)  # rebuilt as a fairscale OSS by the strategy

    def on_train_end(self) -> None:
        optimizer = self.trainer.optimizers[0]
        local = sum(t.numel() for state in optimizer.optim.state.values() for t in state.values() if t.dim() > 0)
        print(f"rank {self.global_rank}: {type(optimizer).__name__}, {local} optimizer-state elements here")


def main() -> int:
    data = TensorDataset(torch.randn(256, 32), torch.randn(256, 32))
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=CustomDDPSharded(start_method="fork"),
            max_epochs=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp,
        )
        trainer.fit(MLP(), DataLoader(data, batch_size=16))
        (checkpoint_path,) = Path(tmp).rglob("*.ckpt")
        checkpoint = torch.load(checkpoint_path, weights_only=False)
    state = checkpoint["optimizer_states"][0]["state"]
    parameters = sum(p.numel() for p in MLP().parameters())
    full = sum(t.numel() for entry in state.values() for t in entry.values() if t.dim() > 0)
    print(f"checkpoint: {len(state)} parameter tensors, {full} optimizer-state elements (2 x {parameters} parameters)")
    assert full == 2 * parameters  # Adam's exp_avg and exp_avg_sq for every parameter: the consolidated state
    return 0


if __name__ == "__main__":
    sys.exit(main())
