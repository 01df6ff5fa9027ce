"""A fit resumed from a mid-epoch checkpoint on another number of ranks, in two popen jobs (the launcher re-runs
this file for every rank but the first, so each job runs on one number of ranks).

Usage: python reliability_resume_other_world.py OUT_DIR {first,resumed} DEVICES

* phase ``first``: fits ``first`` (the user's order) and ``first_shuffled`` (``shuffle_batches_between_ranks``,
  ``shuffle_window=2``), one epoch of 12 one-item batches each, checkpointing after global step 3
  (``OUT_DIR/checkpoints/<run>/step=3.ckpt``); rank 0 then copies ``first``'s checkpoint without the number of
  ranks the strategy records in it (``legacy.ckpt``, as a checkpoint of an earlier version).
* phase ``resumed``: ``resumed``, ``resumed_shuffled`` and ``resumed_legacy`` go on from those to 2 epochs.

Each rank writes ``OUT_DIR/<run>/rank<R>.json`` (batches per epoch, warnings, info messages).
"""
import sys
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from reliability_common import DataLoader, IndexDataset, WeightRecorder, run_guarded, strategy, trainer_kwargs

BATCHES = 12  # one-item batches, a custom batch sampler (a list)
CHECKPOINT_STEP = 3
SHUFFLE_SEED, SHUFFLE_WINDOW = 11, 2


def fit(
    out: Path, run: str, devices: int, shuffled: bool, max_epochs: int, ckpt_path: Optional[Path] = None
) -> pl.Trainer:
    run_dir = out / run
    run_dir.mkdir(exist_ok=True)
    model = WeightRecorder(str(run_dir))
    options = {"shuffle_batches_between_ranks": True, "shuffle_window": SHUFFLE_WINDOW, "seed": SHUFFLE_SEED}
    callbacks = [] if ckpt_path else [ModelCheckpoint(
        dirpath=out / "checkpoints" / run, filename="{step}", save_top_k=-1, every_n_train_steps=CHECKPOINT_STEP
    )]
    trainer = pl.Trainer(
        strategy=strategy("popen", **(options if shuffled else {})),
        **trainer_kwargs(devices=devices, max_epochs=max_epochs, enable_checkpointing=bool(callbacks),
                         callbacks=callbacks),
    )
    loader = DataLoader(IndexDataset(BATCHES), batch_sampler=[[i] for i in range(BATCHES)])
    run_guarded(str(run_dir), lambda: trainer.global_rank, lambda: trainer.fit(model, loader, ckpt_path=ckpt_path))
    return trainer


if __name__ == "__main__":
    out, phase, devices = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    checkpoints = out / "checkpoints"
    if phase == "first":
        trainer = fit(out, "first", devices, shuffled=False, max_epochs=1)
        fit(out, "first_shuffled", devices, shuffled=True, max_epochs=1)
        if trainer.global_rank == 0:
            checkpoint = torch.load(checkpoints / "first" / f"step={CHECKPOINT_STEP}.ckpt", weights_only=False)
            checkpoint.pop("lightning_ddp_ext", None)
            torch.save(checkpoint, checkpoints / "legacy.ckpt")
    else:
        fit(out, "resumed", devices, False, 2, checkpoints / "first" / f"step={CHECKPOINT_STEP}.ckpt")
        fit(out, "resumed_shuffled", devices, True, 2, checkpoints / "first_shuffled" / f"step={CHECKPOINT_STEP}.ckpt")
        fit(out, "resumed_legacy", devices, False, 2, checkpoints / "legacy.ckpt")
