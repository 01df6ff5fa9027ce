"""One "node" of a 2-node job on this machine: Trainer(num_nodes=2, devices=1, strategy=CustomDDP(...)).

Usage: python reliability_multinode.py OUT_DIR [--empty-sampler-on-rank-1]

Started twice, either by ``torchrun --nnodes=2 --nproc_per_node=1 --node_rank=i`` (Lightning picks its
TorchElasticEnvironment) or directly with MASTER_ADDR/MASTER_PORT/NODE_RANK/WORLD_SIZE set (Lightning's
default LightningEnvironment). Nothing here is specific to either: the cluster environment is Lightning's.
Each rank writes ``OUT_DIR/rank<R>.json`` with its batches and the environment it ran in.

``--empty-sampler-on-rank-1`` gives rank 1 an empty batch sampler, which fails while its loader is dealt: a
fault on one rank only, in a job where no launcher watches the other rank (nothing would end it but the
process-group timeout).
"""
import sys

import lightning.pytorch as pl
from reliability_common import (
    DataLoader, IndexDataset, WeightRecorder, env_rank, pk_loader, run_guarded, strategy, trainer_kwargs,
)

if __name__ == "__main__":
    out_dir = sys.argv[1]
    empty_on_rank_1 = "--empty-sampler-on-rank-1" in sys.argv[2:]
    trainer = pl.Trainer(
        strategy=strategy("popen", shuffle_batches_between_ranks=True),
        **trainer_kwargs(devices=1, num_nodes=2, max_epochs=2),
    )
    if empty_on_rank_1 and env_rank() == 1:
        loader = DataLoader(IndexDataset(8), batch_sampler=[])
    else:
        loader = pk_loader(size=64)
    run_guarded(out_dir, lambda: trainer.global_rank, lambda: trainer.fit(WeightRecorder(out_dir), loader))
