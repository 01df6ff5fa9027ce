"""One "node" of a 2-node job on this machine: Trainer(num_nodes=2, devices=1, strategy=CustomDDP(...)).

Usage: python reliability_multinode.py OUT_DIR [--loaders CASE]

Started twice, either by ``torchrun --nnodes=2 --nproc_per_node=1 --node_rank=i`` (Lightning picks its
TorchElasticEnvironment) or directly with MASTER_ADDR/MASTER_PORT/NODE_RANK/WORLD_SIZE set (Lightning's
default LightningEnvironment). Nothing here is specific to either: the cluster environment is Lightning's.
Each rank writes ``OUT_DIR/rank<R>.json`` with its batches and the environment it ran in, or ``rank<R>.error``.

``--loaders`` gives the ranks other loaders (see LOADER_CASES), most of them loaders that must fail, on every
rank, before training: no launcher watches both ranks here, so each rank's own error shows what it saw.
"""
import argparse
from typing import Callable, Dict, Iterator, Tuple

import lightning.pytorch as pl
import torch
from reliability_common import (
    DataLoader, IndexDataset, PKBatches, WeightRecorder, env_rank, labels_for, pk_loader, run_guarded, strategy,
    trainer_kwargs,
)
from torch.utils.data import IterableDataset


class Stream(IterableDataset):
    """An iterable dataset: CustomDDP does not deal it (it must shard itself)."""

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, int]]:
        return ((torch.tensor([float(i)]), i) for i in range(8))


class OtherStream(Stream):
    """Another class of iterable dataset, as another rank may read another file format."""


#: Case -> the train loader of a rank (given its rank).
LOADER_CASES: Dict[str, Callable[[int], DataLoader]] = {
    # trains: loaders that are not dealt match whatever their classes
    "streams-of-two-classes": lambda rank: DataLoader(OtherStream() if rank else Stream()),
    # fails on rank 1 only, while its loader is dealt: rank 0 is already in the cross-rank length check
    "empty-sampler-on-rank-1": lambda rank: (
        DataLoader(IndexDataset(8), batch_sampler=[]) if rank == 1 else pk_loader(size=64)
    ),
    # rank 0 deals nothing, rank 1 fails while dealing: rank 0 must not wait for rank 1 in a check it skips
    "stream-on-rank-0-empty-sampler-on-rank-1": lambda rank: (
        DataLoader(IndexDataset(8), batch_sampler=[]) if rank == 1 else DataLoader(Stream())
    ),
    # rank 0 deals nothing, rank 1 deals its loader: they would step different numbers of times
    "stream-on-rank-0": lambda rank: pk_loader(size=64) if rank == 1 else DataLoader(Stream()),
    # every rank draws its own sequence
    "unseeded": lambda rank: DataLoader(IndexDataset(64), batch_sampler=PKBatches(labels_for(64), 2, 4, seed=None)),
    # 8 batches on rank 0, 9 on rank 1
    "length-by-rank": lambda rank: DataLoader(
        IndexDataset(72), batch_sampler=PKBatches(labels_for(64 + 8 * rank), 2, 4)
    ),
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--loaders", choices=sorted(LOADER_CASES))
    args = parser.parse_args()
    trainer = pl.Trainer(
        strategy=strategy("popen", shuffle_batches_between_ranks=True),
        **trainer_kwargs(devices=1, num_nodes=2, max_epochs=2),
    )
    loader = LOADER_CASES[args.loaders](env_rank()) if args.loaders else pk_loader(size=64)
    run_guarded(args.out_dir, lambda: trainer.global_rank, lambda: trainer.fit(WeightRecorder(args.out_dir), loader))
