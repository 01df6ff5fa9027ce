"""Subclassing CustomDDP: ``init_ddp_connection`` and ``configure_ddp``, and one all-reduce per optimizer step.

The subclass below registers a DDP communication hook that counts gradient all-reduce rounds (it works on
CPU with Gloo too), then trains with ``accumulate_grad_batches=4``: CustomDDP skips gradient
synchronisation on the first three micro-batches of every step, so there is exactly one round per optimizer
step. Run it: ``python docs/examples/custom_hooks.py``.
"""
import datetime
from typing import List, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_ext import CustomDDP

ALLREDUCE_ROUNDS = [0]


def counting_allreduce(state, bucket):  # noqa: ANN001, ANN201 (DDP inspects this signature: keep it plain)
    if bucket.is_last():  # a round ends with its last bucket
        ALLREDUCE_ROUNDS[0] += 1
    return default_hooks.allreduce_hook(state, bucket)


class CountingDDP(CustomDDP):
    def init_ddp_connection(self, global_rank: int, world_size: int) -> None:
        super().init_ddp_connection(global_rank, world_size)  # the default: Gloo on CPU, NCCL on CUDA
        self.backend = dist.get_backend()

    def configure_ddp(self, model: torch.nn.Module, device_ids: Optional[List[int]]) -> torch.nn.Module:
        ddp = DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs)
        ddp.register_comm_hook(state=None, hook=counting_allreduce)
        return ddp


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        print(f"rank {self.global_rank}: backend {strategy.backend}, {self.trainer.global_step} optimizer steps,"
              f" {ALLREDUCE_ROUNDS[0]} gradient all-reduce rounds")
        assert strategy.backend == "gloo"
        assert ALLREDUCE_ROUNDS[0] == self.trainer.global_step == 4  # 16 micro-batches per rank / 4


if __name__ == "__main__":
    data = TensorDataset(torch.randn(128, 4), torch.randn(128, 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=CountingDDP(timeout=datetime.timedelta(minutes=2)),  # every DDPStrategy argument still works
        accumulate_grad_batches=4,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=4))
