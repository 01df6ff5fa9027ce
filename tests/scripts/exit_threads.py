"""A 2-rank fit whose ranks write down which threads they still have once every exit handler has run.

A Gloo process group still alive at interpreter finalisation keeps its worker threads, and such a worker that
takes the GIL then aborts the process (SIGABRT, "terminate called without an active exception"). Each rank writes
``during_rank<R>.txt`` at the end of training (its Gloo threads must show there, or this check sees nothing) and
``exit_rank<R>.txt`` from an exit handler registered when the rank starts, which therefore runs after every
other (atexit runs last-in first-out). Thread names come from ``/proc`` (Linux).

Usage: python exit_threads.py OUT_DIR KIND, KIND one of ddp, ddp_zero (torch's ZeroRedundancyOptimizer),
ddp_module_group (the LightningModule keeps the default group for collectives of its own),
ddp_failing (rank 1 raises in its third step; only that rank's files are written), ddp_own_init (a subclass whose
init_ddp_connection makes the group without super()), sharded, sharded_16_mixed
(fairscale with a ShardedGradScaler), each spawned, or with ``_popen`` appended: the popen launcher, which runs
this file again for rank 1 (and whose script keeps the trainer to the end).
"""
import atexit
import multiprocessing
import os
import sys
from pathlib import Path

OUT, KIND = Path(sys.argv[1]), sys.argv[2]  # spawned ranks get the launcher's sys.argv too
POPEN = KIND.endswith("_popen")


def write_thread_names(name: str) -> None:
    """Write this rank's thread names to ``OUT_DIR/<name>_rank<R>.txt``."""
    if not POPEN and multiprocessing.parent_process() is None:
        return  # the spawn launcher, which trains nothing
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    (OUT / f"{name}_rank{os.environ.get('LOCAL_RANK', '0')}.txt").write_text("\n".join(names))


if POPEN or __name__ != "__main__":  # a rank: registered before anything else, so it runs after every other
    atexit.register(write_thread_names, "exit")

from typing import Any  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_ddp_ext import CustomDDP, CustomDDPSharded  # noqa: E402


class Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def setup(self, stage: str) -> None:
        if KIND.startswith("ddp_module_group"):
            self.sync_group = torch.distributed.group.WORLD

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if KIND.startswith("ddp_failing") and self.global_rank == 1 and batch_idx == 2:
            write_thread_names("during")
            raise RuntimeError("injected failure")
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if KIND.startswith("ddp_zero"):  # torch's sharded optimizer, which holds the default group
            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        write_thread_names("during")


class OwnInitDDP(CustomDDP):
    """Makes the default group itself, without ``super()``, as docs/guides/subclassing.rst's FileRendezvousDDP."""

    def init_ddp_connection(self, global_rank: int, world_size: int) -> None:
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(
                "gloo", init_method=f"file://{OUT / 'rendezvous'}", rank=global_rank, world_size=world_size
            )


if __name__ == "__main__":
    strategy_class = CustomDDPSharded if KIND.startswith("sharded") else OwnInitDDP if "own_init" in KIND else CustomDDP
    strategy = strategy_class(start_method="popen" if POPEN else "spawn")
    # "16-mixed" by name is bf16 on CPU: the plugin keeps float16 and its gradient scaler
    plugins = [MixedPrecision("16-mixed", "cpu")] if "16_mixed" in KIND else []
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=OUT, plugins=plugins,
    )
    try:
        trainer.fit(Linear(), DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4))
    except Exception as error:  # the failing kinds: rank 1's exit is what is checked
        # The spawn launcher reports whichever rank it finds dead first: rank 1 itself, or rank 0, whose gradient
        # all-reduce lost its peer (seen once in CI on Lightning 2.2).
        if not KIND.startswith("ddp_failing") or not any(
            cause in str(error) for cause in ("injected failure", "Connection closed by peer")
        ):
            raise
