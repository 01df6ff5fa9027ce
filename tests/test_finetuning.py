"""Parameters whose ``requires_grad`` changes during a fit (Lightning's ``BaseFinetuning``) train as on one process.

torch's DistributedDataParallel registers its gradient hooks, at construction, for the parameters that require
grad then. A backbone unfrozen at a later epoch is never all-reduced under it (each rank steps on its own
gradient: the ranks' weights drift apart, silently), and a parameter frozen after wrapping leaves DDP waiting
for a gradient that never comes. CustomDDP re-wraps the model when the flags change (Lightning issue #20340).

One 2-rank spawn fit against one 1-process fit on the combined batches: the backbone joins at epoch 1, the
head leaves in the middle of an accumulation window of epoch 2 (its gradient of the window's first batch must
be averaged across ranks, as Adam still steps it), with ``accumulate_grad_batches=2`` and a ``configure_ddp``
override that registers a counting comm hook (re-wrapping must go through the override, and ``no_sync``
must still skip the accumulating steps).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning
from scenarios import TEST_PG_TIMEOUT, trainer_kwargs
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, Dataset

from lightning_ddp_ext import CustomDDP

pytestmark = pytest.mark.usefixtures("spawn_job")

SIZE = 16  # per rank: 4 batches of 2, 2 optimizer steps per epoch with accumulate_grad_batches=2
EPOCHS = 3


class Points(Dataset):
    """Seeded regression points: item i is (x_i, y_i)."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 8, generator=generator)
        self.y = self.x[:, :1] * 2 - self.x[:, 1:2] + 0.1 * torch.randn(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class FineTuned(pl.LightningModule):
    """A backbone and a head; each rank saves its weights and what its strategy recorded to ``rank<R>.pt``."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.head = torch.nn.Linear(4, 1)
        self.out_dir = out_dir

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.01)

    def on_train_end(self) -> None:
        report = {"weights": self.state_dict(), "wraps": getattr(self.trainer.strategy, "wraps", None)}
        torch.save(report, Path(self.out_dir) / f"rank{self.global_rank}.pt")


class Finetuning(BaseFinetuning):
    """The backbone joins the optimizer as a new group at epoch 1; the head is frozen at batch 1 of epoch 2."""

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=0.01)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.current_epoch == 2 and idx == 1:  # the second micro-batch of the epoch's first window
            self.freeze(pl_module.head)


def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]
    """Count the gradient all-reduce rounds of one wrapper, then all-reduce as DDP would (unannotated: DDP
    compares annotations with real classes, and this module's are strings)."""
    state["rounds"] += 1
    return default_hooks.allreduce_hook(None, bucket)


class RecordingDDP(CustomDDP):
    """A user's configure_ddp override: registers a comm hook and records each wrapper it builds."""

    def configure_ddp(self, model: torch.nn.Module, device_ids: Optional[List[int]]) -> torch.nn.Module:
        wrapped = super().configure_ddp(model, device_ids)
        state = {"trainable": sum(p.requires_grad for p in model.parameters()), "rounds": 0}
        wrapped.register_comm_hook(state, counting_allreduce)  # type: ignore[operator]
        self.wraps: List[Dict[str, int]] = [*getattr(self, "wraps", []), state]
        return wrapped


def fit(out_dir: Path, batch_size: int, **overrides: Any) -> None:
    kwargs = trainer_kwargs(callbacks=[Finetuning()], max_epochs=EPOCHS, accumulate_grad_batches=2, **overrides)
    pl.Trainer(**kwargs).fit(FineTuned(str(out_dir)), DataLoader(Points(SIZE), batch_size=batch_size))


@pytest.mark.timeout(300)
def test_parameters_unfrozen_and_frozen_during_fit_train_as_on_one_process(tmp_path: Path) -> None:
    """Fails without re-wrapping: the backbone's gradients stay per rank from epoch 1, so the ranks' backbones
    differ, and differ from the 1-process run's."""
    (tmp_path / "ddp").mkdir()
    (tmp_path / "one").mkdir()
    # per rank: dealt 0, 2, 4, ... and 1, 3, 5, ...; each batch of the 1-process run is the two ranks' together
    fit(tmp_path / "ddp", batch_size=2, strategy=RecordingDDP(start_method="spawn", timeout=TEST_PG_TIMEOUT))
    fit(tmp_path / "one", batch_size=4, devices=1)
    ranks = [torch.load(tmp_path / "ddp" / f"rank{r}.pt", weights_only=True) for r in range(2)]
    reference = torch.load(tmp_path / "one" / "rank0.pt", weights_only=True)["weights"]

    initial = FineTuned(str(tmp_path)).state_dict()
    for name, value in reference.items():
        assert not torch.equal(value, initial[name]), name  # every parameter trained in the reference
        for rank, report in enumerate(ranks):
            difference = (report["weights"][name] - value).abs().max().item()
            assert difference <= 1e-5, (rank, name, difference)
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name

    # Wrapped 3 times through the override: head only (2 tensors), + backbone (6), backbone only (4); each
    # wrapper's comm hook reduced once per optimizer step it ended (2 each: no_sync skipped the accumulating
    # micro-batches, the one before the last re-wrap included).
    for report in ranks:
        assert report["wraps"] == [{"trainable": n, "rounds": 2} for n in (2, 6, 4)], report["wraps"]
