"""Resumes at the edges of an epoch, in one popen job (the launcher re-runs this file for rank 1).

Usage: python reliability_resume_edges.py OUT_DIR

* ``limited``: ``limit_train_batches=4`` of a 6-batch share, 3 epochs; ``limited_first`` stops after step 4
  with a checkpoint there (the limited epoch's last batch, so Lightning starts the next epoch when it resumes);
  ``limited_resumed`` goes on from it to 3 epochs, and so does ``limited_resumed_with_workers``, whose loader
  has a worker process.
* ``cycled``: two loaders in CombinedLoader's default "max_size_cycle" mode, ``a`` with 5 batches per rank
  and ``b`` with 2 (restarted when it runs out), one epoch; ``cycled_first`` stops after step 3 (``b`` one
  batch into its second pass) with a checkpoint; ``cycled_resumed`` finishes the epoch from it.
* ``sized``: the same two loaders in a CombinedLoader of mode "max_size", where ``b`` yields nothing once it
  ran out; ``sized_first`` stops after step 3 (``b`` ran out one step before) with a checkpoint; ``sized_resumed``
  finishes the epoch from it.
* ``user_dealt``: a loader its user dealt with ``patch_dataloader_to_ddp`` in a LightningDataModule, with a
  worker process, 2 epochs; ``user_dealt_first`` stops 2 steps into epoch 1 with a checkpoint;
  ``user_dealt_resumed`` finishes from it.
* ``stateful``: torchdata's ``StatefulDataLoader``, whose position the checkpoint holds and Lightning restores,
  one epoch; ``stateful_first`` stops after step 2 (mid-epoch) with a checkpoint; ``stateful_resumed`` finishes
  the epoch from it.

Each rank writes ``OUT_DIR/<run>/rank<R>.json`` (batches per epoch and loader).
"""
import sys
from pathlib import Path
from typing import Any, Dict, List

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import CombinedLoader
from reliability_common import WeightRecorder, pk_loader, run_guarded, strategy, trainer_kwargs

from lightning_ddp_ext import patch_dataloader_to_ddp

LIMIT, LIMITED_STOP = 4, 4  # batches per limited epoch; the checkpoint is at its last
CYCLED_STOP = 3
USER_DEALT_STOP = 8  # 6 batches per rank and epoch: 2 steps into epoch 1
STATEFUL_STOP = 2


def fit(out_dir: Path, run: str, loaders: Any, ckpt_path: object = None, stop_at: int = -1, **options: Any) -> None:
    run_dir = out_dir / run
    run_dir.mkdir(exist_ok=True)
    callbacks: List[Any] = []
    if stop_at > 0:
        options["max_steps"] = stop_at
        callbacks.append(ModelCheckpoint(dirpath=out_dir / "checkpoints", filename=f"{run}-{{step}}",
                                         every_n_train_steps=stop_at))
    pl.seed_everything(7)
    model = WeightRecorder(str(run_dir))
    trainer = pl.Trainer(
        strategy=strategy("popen"),
        **trainer_kwargs(enable_checkpointing=bool(callbacks), callbacks=callbacks, **options),
    )
    run_guarded(str(run_dir), lambda: trainer.global_rank, lambda: trainer.fit(model, loaders(), ckpt_path=ckpt_path))


def limited_loader() -> Any:
    return pk_loader(size=96)  # 12 batches: 6 per rank, of which the limit trains 4


def limited_loader_with_workers() -> Any:
    return pk_loader(size=96, num_workers=1)  # its iterator reads the sampler as soon as it is made


def stateful_loader() -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    plain = pk_loader(size=96)
    return StatefulDataLoader(plain.dataset, batch_sampler=plain.batch_sampler)


def two_loaders() -> Dict[str, Any]:
    return {"a": pk_loader(size=80), "b": pk_loader(size=32, seed=2)}


def two_loaders_max_size() -> CombinedLoader:
    return CombinedLoader(two_loaders(), mode="max_size")


class UserDealt(pl.LightningDataModule):
    """A training loader dealt by its user (after the process group exists), read by a worker process."""

    def train_dataloader(self) -> Any:
        return patch_dataloader_to_ddp(pk_loader(size=96, num_workers=1))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    checkpoints = out / "checkpoints"
    limited = dict(max_epochs=3, limit_train_batches=LIMIT)
    fit(out, "limited", limited_loader, **limited)
    fit(out, "limited_first", limited_loader, stop_at=LIMITED_STOP, **limited)
    limited_checkpoint = checkpoints / f"limited_first-step={LIMITED_STOP}.ckpt"
    fit(out, "limited_resumed", limited_loader, ckpt_path=limited_checkpoint, **limited)
    fit(out, "limited_resumed_with_workers", limited_loader_with_workers, ckpt_path=limited_checkpoint, **limited)
    fit(out, "cycled", two_loaders, max_epochs=1)
    fit(out, "cycled_first", two_loaders, stop_at=CYCLED_STOP, max_epochs=1)
    fit(out, "cycled_resumed", two_loaders, ckpt_path=checkpoints / f"cycled_first-step={CYCLED_STOP}.ckpt", max_epochs=1)
    fit(out, "sized", two_loaders_max_size, max_epochs=1)
    fit(out, "sized_first", two_loaders_max_size, stop_at=CYCLED_STOP, max_epochs=1)
    fit(out, "sized_resumed", two_loaders_max_size, ckpt_path=checkpoints / f"sized_first-step={CYCLED_STOP}.ckpt",
        max_epochs=1)
    fit(out, "user_dealt", UserDealt, max_epochs=2)
    fit(out, "user_dealt_first", UserDealt, stop_at=USER_DEALT_STOP, max_epochs=2)
    fit(out, "user_dealt_resumed", UserDealt, ckpt_path=checkpoints / f"user_dealt_first-step={USER_DEALT_STOP}.ckpt",
        max_epochs=2)
    fit(out, "stateful", stateful_loader, max_epochs=1)
    fit(out, "stateful_first", stateful_loader, stop_at=STATEFUL_STOP, max_epochs=1)
    fit(out, "stateful_resumed", stateful_loader, ckpt_path=checkpoints / f"stateful_first-step={STATEFUL_STOP}.ckpt",
        max_epochs=1)
