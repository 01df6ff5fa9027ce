"""Five fits in one popen job (the launcher re-runs this file for rank 1), for the resume tests.

Usage: python reliability_resume.py OUT_DIR [NUM_WORKERS]

* ``two_epochs``: 2 epochs, checkpointing at every epoch end and after global step 8 (mid-epoch 1);
* ``resumed``: from the end-of-epoch-2 checkpoint (``ckpt_path``) to 3 epochs;
* ``resumed_reloading``: the same with ``reload_dataloaders_every_n_epochs=1``;
* ``uninterrupted``: 3 epochs from scratch;
* ``resumed_mid_epoch``: from the step-8 checkpoint to 3 epochs.

Every fit builds a new Trainer, model, sampler and loader, as a restarted job would; the two ranks and their
process group are reused between fits (Lightning's popen launcher starts its children once per script).
Each rank writes ``OUT_DIR/<run>/rank<R>.json`` (batches per epoch, warnings) and ``weights_rank<R>.pt``.
"""
import sys
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from reliability_common import WeightRecorder, pk_loader, run_guarded, strategy, trainer_kwargs

#: 96 samples in P x K batches of 8: 12 batches per epoch, 6 per rank, a new draw every epoch.
SIZE = 96
MID_EPOCH_STEP = 8  # the 2nd optimizer step of epoch 1


def fit(
    out_dir: Path, run: str, max_epochs: int, workers: int, ckpt_path: object = None, callbacks: list = (), **options
) -> None:
    run_dir = out_dir / run
    run_dir.mkdir(exist_ok=True)
    pl.seed_everything(7, workers=True)
    model = WeightRecorder(str(run_dir))
    trainer = pl.Trainer(
        strategy=strategy("popen", shuffle_batches_between_ranks=True, seed=11),
        deterministic=True,
        **trainer_kwargs(max_epochs=max_epochs, enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
                         **options),
    )
    run_guarded(str(run_dir), lambda: trainer.global_rank,
                lambda: trainer.fit(model, pk_loader(size=SIZE, num_workers=workers), ckpt_path=ckpt_path))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    checkpoints = out / "checkpoints"
    fit(out, "two_epochs", 2, workers, callbacks=[
        ModelCheckpoint(dirpath=checkpoints, filename="end-{epoch}", save_top_k=-1, every_n_epochs=1),
        ModelCheckpoint(dirpath=checkpoints, filename="mid-{step}", save_top_k=-1,
                        every_n_train_steps=MID_EPOCH_STEP),
    ])
    fit(out, "resumed", 3, workers, ckpt_path=checkpoints / "end-epoch=1.ckpt")
    fit(out, "resumed_reloading", 3, workers, ckpt_path=checkpoints / "end-epoch=1.ckpt",
        reload_dataloaders_every_n_epochs=1)
    fit(out, "uninterrupted", 3, workers)
    fit(out, "resumed_mid_epoch", 3, workers, ckpt_path=checkpoints / f"mid-step={MID_EPOCH_STEP}.ckpt")
