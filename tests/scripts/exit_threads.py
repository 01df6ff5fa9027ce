"""A 2-rank spawn fit whose ranks write down which threads they still have once every exit handler has run.

A Gloo process group still alive at interpreter finalisation keeps its worker threads, and such a worker that
takes the GIL then aborts the process (SIGABRT, "terminate called without an active exception"). Each rank writes
``during_rank<R>.txt`` at the end of training (its Gloo threads must show there, or this check sees nothing) and
``exit_rank<R>.txt`` from an exit handler registered when the rank starts, which therefore runs after every
other (atexit runs last-in first-out). Thread names come from ``/proc`` (Linux).

Usage: python exit_threads.py OUT_DIR {ddp,sharded,sharded_16_mixed}
"""
import atexit
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_ext import CustomDDP, CustomDDPSharded


def write_thread_names(name: str) -> None:
    """Write this rank's thread names to ``OUT_DIR/<name>_rank<R>.txt`` (ranks only)."""
    if multiprocessing.parent_process() is None:
        return
    tasks = Path("/proc/self/task")
    names = [(tasks / task / "comm").read_text().strip() for task in os.listdir(tasks)]
    Path(os.environ["EXIT_THREADS_OUT"], f"{name}_rank{os.environ['LOCAL_RANK']}.txt").write_text("\n".join(names))


class Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        write_thread_names("during")


if __name__ == "__main__":
    os.environ["EXIT_THREADS_OUT"] = sys.argv[1]  # the spawned ranks inherit it
    kind = sys.argv[2]
    strategy = (CustomDDP if kind == "ddp" else CustomDDPSharded)(start_method="spawn")
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=sys.argv[1], precision="16-mixed" if kind.endswith("16_mixed") else 32,
    )
    trainer.fit(Linear(), DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4))
else:  # a spawned rank imports this file as __mp_main__ before it runs anything else
    atexit.register(write_thread_names, "exit")
