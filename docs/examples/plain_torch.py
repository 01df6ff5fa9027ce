"""The sampler layer without Lightning: plain ``torch.distributed`` on 2 CPU processes.

Each process wraps the same single-process DataLoader with ``patch_dataloader_to_ddp``, trains a DDP model
on its share of a length-bucketing batch sampler, then evaluates its share and gathers every rank's outputs
in dataset order. Run it: ``python docs/examples/plain_torch.py``.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Iterator, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp_ext import patch_dataloader_to_ddp
from lightning_ddp_ext.consistency import verify_same_sequence
from lightning_ddp_ext.sync import gather_in_order

WORLD_SIZE = 2


class LengthBuckets:
    """Batches of items of similar length, longest first, at most `budget` tokens per batch."""

    def __init__(self, lengths: List[int], budget: int) -> None:
        self.batches: List[List[int]] = []
        batch: List[int] = []
        for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            if batch and (len(batch) + 1) * lengths[batch[0]] > budget:
                self.batches.append(batch)
                batch = []
            batch.append(index)
        self.batches.append(batch)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[List[int]]:
        return iter(self.batches)


def worker(rank: int, rendezvous: str) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(0)  # the same initial model on every rank
    lengths = [(7 * i) % 23 + 1 for i in range(60)]
    data = TensorDataset(torch.tensor(lengths, dtype=torch.float32)[:, None], torch.arange(60))
    loader = DataLoader(data, batch_sampler=LengthBuckets(lengths, budget=48))

    # This rank's share: batches rank, rank + 2, ... of the sampler's sequence, padded to equal counts.
    train_loader = patch_dataloader_to_ddp(loader)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    wrapper = train_loader.batch_sampler
    for epoch in range(2):
        # On loader.batch_sampler.sampler, or on loader.sampler for a loader with batch_size=None.
        train_loader.batch_sampler.sampler.set_epoch(epoch)
        for step, (x, _) in enumerate(train_loader):
            if step == 0:
                # Every rank must deal the same sequence with the same options (an unseeded sampler would not):
                # a collective that raises on every rank, naming the sampler, when they differ. Here, before the
                # first backward pass: a rank with fewer batches must not be left waiting in DDP's all-reduce.
                verify_same_sequence(wrapper.head_digest, wrapper.epoch_digest)
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
    verify_same_sequence(wrapper.epoch_digest)  # the last epoch as a whole (the next epoch would compare it)

    # Evaluation: each rank runs its share, then every rank gets all outputs in dataset order, once each.
    eval_loader = patch_dataloader_to_ddp(loader, pad=True)
    outputs, indices = [], []
    with torch.no_grad():
        for x, index in eval_loader:
            outputs.append(model(x))
            indices.append(index)
    everything = gather_in_order(torch.cat(outputs), torch.cat(indices), dataset_size=len(data))
    expected = model.module(data.tensors[0]).detach()
    assert torch.allclose(everything, expected), "gathered outputs differ from a single-process pass"
    if rank == 0:
        print(f"{len(train_loader)} batches per rank of {len(loader)}; gathered {tuple(everything.shape)} outputs")
    # Free the DDP wrapper before the group it holds: a wrapper freed after destroy_process_group (here, when
    # this function returns) can hang in its destructor.
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        # "fork" reuses this process's imports; "spawn" (torch.multiprocessing.spawn) works everywhere, slower.
        mp.start_processes(worker, args=(Path(tmp, "rendezvous").as_uri(),), nprocs=WORLD_SIZE, start_method="fork")
    sys.exit(0)
