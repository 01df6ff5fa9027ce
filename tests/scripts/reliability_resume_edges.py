"""Resumes at the edges of an epoch, in one popen job (the launcher re-runs this file for rank 1).

Usage: python reliability_resume_edges.py OUT_DIR

* ``limited``: ``limit_train_batches=4`` of a 6-batch share, 3 epochs; ``limited_first`` stops after step 4
  with a checkpoint there (the limited epoch's last batch, so Lightning starts the next epoch when it resumes);
  ``limited_resumed`` goes on from it to 3 epochs, and so does ``limited_resumed_with_workers``, whose loader
  has a worker process.
* ``cycled``: three loaders in CombinedLoader's default "max_size_cycle" mode, ``a`` with 5 batches per rank,
  ``b`` and ``c`` (an index sampler) with 2 (restarted when they run out), one epoch; ``cycled_first`` stops
  after step 3 (``b`` and ``c`` one batch into their second pass) with a checkpoint; ``cycled_resumed``
  finishes the epoch from it.
* ``grown``: a curriculum batch sampler whose epochs grow through ``set_epoch`` (2, 4 and 6 batches per rank),
  with ``reload_dataloaders_every_n_epochs=1``, 3 epochs; ``grown_first`` stops after step 6 (epoch 1's last
  batch) with a checkpoint there; ``grown_resumed`` goes on from it, with the next epoch (longer than the
  restored one). ``grown_stale`` fits it for 3 epochs without ``reload_dataloaders_every_n_epochs``.
  ``grown_validated`` (and its ``_first`` and ``_resumed``) likewise, validated twice an epoch, with the checkpoint
  written by ``ModelCheckpoint(monitor=...)`` after the validation at epoch 1's end (Lightning finishes that epoch,
  with nothing left, when it resumes). ``grown_hooked`` likewise (checkpoint in the batch's hook), with a
  ``train_dataloader`` hook that sizes a batch sampler without ``set_epoch`` by ``trainer.current_epoch``.
  ``grown_again`` resumes ``grown_first`` and stops 3 batches into epoch 2 with a checkpoint there;
  ``grown_again_resumed`` goes on from it (to 3 epochs).
  ``grown_beside``: the growing loader ``b`` beside a loader ``a`` of 8 batches per rank, no reloading, 3 epochs.
  ``grown_late``: with reloading, a callback raises the sampler's level in ``on_train_epoch_start``.
* ``unsized``: a loader over an IterableDataset without a length (4 batches, on every rank), one epoch.
* ``sized``: the same three loaders in a CombinedLoader of mode "max_size", where ``b`` and ``c`` yield
  nothing once they ran out; ``sized_first`` stops after step 3 (they ran out one step before) with a
  checkpoint; ``sized_resumed`` finishes the epoch from it.
* ``user_dealt``: a loader its user dealt with ``patch_dataloader_to_ddp`` in a LightningDataModule, with a
  worker process, 2 epochs; ``user_dealt_first`` stops 2 steps into epoch 1 with a checkpoint;
  ``user_dealt_resumed`` finishes from it.
* ``user_batched``: as ``user_dealt``, but the loader's ``batch_sampler=`` is torch's plain ``BatchSampler`` over
  a ``DistributedSamplerWrapper`` (shuffled) of a custom index sampler; ``user_batched_first`` and
  ``user_batched_resumed`` likewise.
* ``estimating``: a model whose ``configure_optimizers`` reads ``trainer.estimated_stepping_batches``, a loader
  with a worker process, 2 epochs; ``estimating_first`` stops 2 steps into epoch 1 with a checkpoint;
  ``estimating_resumed`` finishes from it.
* ``early``: as ``estimating``, but the model reads ``trainer.estimated_stepping_batches`` in its ``setup``
  hook (Lightning sets the train loader up before it loads the checkpoint); ``early_first`` and
  ``early_resumed`` likewise.
* ``user_sharded``: a loader its user sharded with torch's ``DistributedSampler``, with a worker process, 2
  epochs; ``user_sharded_first`` stops at the end of epoch 0 with a checkpoint; ``user_sharded_resumed`` trains
  epoch 1 from it. ``user_sharded_batched`` (and its ``_first`` and ``_resumed``) likewise, with the
  ``DistributedSampler`` under torch's plain ``BatchSampler`` given as ``batch_sampler=``.
* ``shared``: one loader its user dealt serves training and validation; ``shared_first`` stops after step 2
  with a checkpoint; ``shared_resumed`` resumes it with no step left to train, then trains one epoch with
  ``use_distributed_sampler=False``, then validates.
* ``validating``: the shared loader, validated every 2 training batches, one epoch, writing a checkpoint in
  the step of the first batch of its first validation; ``validating_resumed`` goes on from it, finishing that validation
  before it trains.
* ``stateful``: torchdata's ``StatefulDataLoader``, whose position the checkpoint holds and Lightning restores,
  one epoch; ``stateful_first`` stops after step 2 (mid-epoch) with a checkpoint; ``stateful_resumed`` finishes
  the epoch from it, and so do ``stateful_early_resumed``, whose model reads
  ``trainer.estimated_stepping_batches`` in its ``setup`` hook, and ``stateful_estimating_resumed``, whose model
  reads it in ``configure_optimizers``.
* ``stateful_streams``: that model, with a stateful loader ``stream`` over an IterableDataset (not dealt, so no
  wrapper of ours is there to prepare), 2 epochs; ``stateful_streams_first`` stops 2 steps into epoch 1 with a
  checkpoint; ``stateful_streams_resumed`` finishes from it. ``stateful_streams_reloaded`` (and its ``_first``
  and ``_resumed``) likewise, with ``reload_dataloaders_every_n_epochs=1`` and a second stateful loader,
  ``dealt`` (as in ``stateful``). ``stateful_streams_on_fit_start_resumed`` resumes ``stateful_streams_first`` with
  a model that reads ``trainer.estimated_stepping_batches`` in ``on_fit_start``.
* ``generator``: a generator of batches (one-shot, not dealt), one epoch; ``generator_first`` stops after step 2
  with a checkpoint; ``generator_resumed`` and ``generator_early_resumed`` (the ``setup``-hook model) go on from it.
  ``generator_cycled_first`` (and its ``_resumed``, ``_estimating_resumed`` and ``_early_resumed``) likewise, with
  a generator ``g`` of 12 batches beside a dealt loader ``a`` of 6 that restarts once (12 steps).
* ``early_own_optimizers_resumed``: ``early_resumed`` under a strategy whose Lightning does not call
  ``load_optimizer_state_dict``; ``own_optimizers_resumed`` likewise with a model that reads nothing early.
* ``stateful_used_trainer``: see :func:`resume_on_a_used_trainer` (``stateful_first4`` stops after step 4
  with a checkpoint).
* ``stateful_mixed``: a model reading ``trainer.estimated_stepping_batches`` in ``configure_optimizers``, a
  stateful loader ``s`` beside a plain one with a worker, ``plain``, one epoch; ``stateful_mixed_first`` stops
  after step 2 with a checkpoint; ``stateful_mixed_resumed`` finishes from it.

Each rank writes ``OUT_DIR/<run>/rank<R>.json`` (batches per epoch and loader).
"""
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import CombinedLoader
from reliability_common import (
    DataLoader, EveryThirdFirst, IndexDataset, WeightRecorder, pk_loader, run_guarded, strategy, trainer_kwargs,
    worker_context,
)
from torch.utils.data import BatchSampler, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from lightning_ddp_ext import CustomDDP, patch_dataloader_to_ddp
from lightning_ddp_ext.samplers import DistributedSamplerWrapper

LIMIT, LIMITED_STOP = 4, 4  # batches per limited epoch; the checkpoint is at its last
CYCLED_STOP = 3
ENDED_BY_MAX_STEPS = 3  # of the 6 batches a rank of the first epoch
GROWN_STOP = 6  # the last batch of epoch 1 (2 + 4 batches per rank)
GROWN_AGAIN = 9  # 3 batches into epoch 2
RESHUFFLED_AGAIN = 8  # after the rest of the first epoch, 2 batches into the second
USER_DEALT_STOP = 8  # 6 batches per rank and epoch: 2 steps into epoch 1
USER_SHARDED_STOP = 6  # the end of epoch 0
SHARED_STOP = 2
STATEFUL_STOP = 2


def fit(out_dir: Path, run: str, loaders: Any, ckpt_path: object = None, stop_at: int = -1,
        model_class: Any = WeightRecorder, strategy_class: Any = CustomDDP, at_epoch_end: bool = False,
        in_validation: bool = False, **options: Any) -> None:
    """One fit; ``stop_at`` ends it after that step with a checkpoint written there, with ``at_epoch_end`` at the
    end of the epoch that max_steps cut short (ModelCheckpoint's default), with ``in_validation`` after the
    validation at that step (a ``LogsValidation`` model's monitored value)."""
    run_dir = out_dir / run
    run_dir.mkdir(exist_ok=True)
    callbacks: List[Any] = list(options.pop("callbacks", []))
    if stop_at > 0:
        options["max_steps"] = stop_at
        every_n = {} if at_epoch_end else {"every_n_train_steps": stop_at}
        every_n = {"monitor": "step_seen", "mode": "max"} if in_validation else every_n
        callbacks.append(ModelCheckpoint(dirpath=out_dir / "checkpoints", filename=f"{run}-{{step}}", **every_n))
    pl.seed_everything(7)
    model = model_class(str(run_dir))
    trainer = pl.Trainer(
        strategy=strategy("popen", strategy_class=strategy_class),
        **trainer_kwargs(enable_checkpointing=stop_at > 0, callbacks=callbacks, **options),
    )
    run_guarded(str(run_dir), lambda: trainer.global_rank, lambda: trainer.fit(model, loaders(), ckpt_path=ckpt_path))


def fit_interrupted(
    out_dir: Path, run: str, loaders: Any, stop_at: int, at_epoch_end: bool = False, in_validation: bool = False,
    **options: Any
) -> Path:
    """``run`` uninterrupted, ``<run>_first`` stopping after step ``stop_at`` with a checkpoint (see :func:`fit`),
    and ``<run>_resumed`` from it; the checkpoint, for other resumes."""
    fit(out_dir, run, loaders, **options)
    fit(out_dir, f"{run}_first", loaders, stop_at=stop_at, at_epoch_end=at_epoch_end, in_validation=in_validation,
        **options)
    checkpoint = out_dir / "checkpoints" / f"{run}_first-step={stop_at}.ckpt"
    fit(out_dir, f"{run}_resumed", loaders, ckpt_path=checkpoint, **options)
    return checkpoint


def curriculum_loader() -> Any:
    return DataLoader(IndexDataset(48), sampler=EveryThirdFirst(48), batch_size=4)  # 6 batches a rank, every epoch


class Reshuffled(torch.utils.data.Sampler[int]):
    """An index sampler that draws a new order every epoch (seeded by it), as most do."""

    def __init__(self, size: int) -> None:
        self.size, self.epoch = size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.size, generator=torch.Generator().manual_seed(self.epoch)).tolist())

    def __len__(self) -> int:
        return self.size


class Growing:
    """A curriculum: epoch ``e`` draws the first ``16 * (e + 1)`` items (at most 48), shuffled by ``e``, in
    batches of 4; its length follows the epoch set."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _items(self) -> int:
        return min(48, 16 * (self.epoch + 1))

    def __len__(self) -> int:
        return self._items() // 4

    def __iter__(self) -> Iterator[List[int]]:
        order = torch.randperm(self._items(), generator=torch.Generator().manual_seed(self.epoch)).tolist()
        return iter([order[k:k + 4] for k in range(0, len(order), 4)])


def growing_loader() -> Any:
    return DataLoader(IndexDataset(48), batch_sampler=Growing())


class UnsizedStream(IterableDataset):
    """The first ``size`` items of an ``IndexDataset``, with no ``__len__``."""

    def __init__(self, size: int) -> None:
        self.items = IndexDataset(size)

    def __iter__(self) -> Iterator[Any]:
        return (self.items[i] for i in range(len(self.items)))


def unsized_loader() -> Any:
    return DataLoader(UnsizedStream(16), batch_size=4)


def growing_beside_a_longer_one() -> Dict[str, Any]:
    return {"a": pk_loader(size=128), "b": growing_loader()}  # a: 8 batches per rank; b: 2, 4 and 6


class GrowsWhenTold(Growing):
    """``Growing`` sized by its ``level`` (which a callback sets), not by the epoch, which only seeds its shuffle."""

    def __init__(self) -> None:
        super().__init__()
        self.level = 0

    def _items(self) -> int:
        return min(48, 16 * (self.level + 1))


class RaisesLevelAtEpochStart(pl.Callback):
    """Sets the sampler's level to the epoch in ``on_train_epoch_start``: after Lightning read the loader's length."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.train_dataloader.batch_sampler.level = trainer.current_epoch  # through the wrapper, to the user's


def told_loader() -> Any:
    return DataLoader(IndexDataset(48), batch_sampler=GrowsWhenTold())


class GrownValidated(pl.LightningDataModule):
    """The growing loader, with a validation loader."""

    def train_dataloader(self) -> Any:
        return growing_loader()

    def val_dataloader(self) -> Any:
        return DataLoader(IndexDataset(8), batch_size=4)


class GrownByHook(pl.LightningDataModule):
    """A curriculum the ``train_dataloader`` hook sizes by ``trainer.current_epoch``, as ``Growing`` for that epoch,
    over a batch sampler that has no ``set_epoch`` (the loaders are set up again for every epoch)."""

    def train_dataloader(self) -> Any:
        fixed = Growing()
        fixed.epoch = self.trainer.current_epoch
        return DataLoader(IndexDataset(48), batch_sampler=list(fixed))


class LogsValidation(WeightRecorder):
    """Logs the global step in validation, for ``ModelCheckpoint(monitor="step_seen")``."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.log("step_seen", float(self.global_step), sync_dist=True)


def reshuffled_loader() -> Any:
    return DataLoader(IndexDataset(48), sampler=Reshuffled(48), batch_size=4)  # 6 batches a rank, every epoch


def limited_loader() -> Any:
    return pk_loader(size=96)  # 12 batches: 6 per rank, of which the limit trains 4


def limited_loader_with_workers() -> Any:
    return pk_loader(size=96, num_workers=1)  # its iterator reads the sampler as soon as it is made


def stateful_loader() -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    plain = pk_loader(size=96)
    return StatefulDataLoader(plain.dataset, batch_sampler=plain.batch_sampler)


class Stream(IterableDataset):
    """The items of an ``IndexDataset`` in order, on every rank alike (sharding it would be its own job)."""

    def __init__(self, size: int) -> None:
        self.items = IndexDataset(size)

    def __iter__(self) -> Iterator[Any]:
        return (self.items[i] for i in range(len(self.items)))

    def __len__(self) -> int:  # sized: Lightning then fetches no batch ahead, which the loader's state would count
        return len(self.items)


def stateful_stream() -> Dict[str, Any]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return {"stream": StatefulDataLoader(Stream(48), batch_size=8)}


def stateful_streams() -> Dict[str, Any]:
    return {"dealt": stateful_loader(), **stateful_stream()}


def batch_generator(size: int = 48) -> Any:
    """Batches of 8 ``IndexDataset`` items, which no one can iterate twice."""
    items = IndexDataset(size)
    return ((torch.stack([items[i][0] for i in range(b, b + 8)]), torch.arange(b, b + 8)) for b in range(0, size, 8))


def stateful_and_plain() -> Dict[str, Any]:
    """A stateful loader ``s`` beside a plain one with a worker, ``plain``: 6 batches per rank each."""
    return {"s": stateful_loader(), "plain": loader_with_workers()}


def cycled_with_a_generator() -> CombinedLoader:
    """``a`` (6 batches per rank) restarts while the generator ``g`` (6 of its 12 batches per epoch) goes on."""
    return CombinedLoader({"a": pk_loader(size=96), "g": batch_generator(96)}, mode="max_size_cycle")


class RestoresItsOwnOptimizers(CustomDDP):
    """A strategy that restores optimizer states itself, so Lightning does not call its load_optimizer_state_dict."""

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False


def two_loaders() -> Dict[str, Any]:
    # "c": a custom index sampler, whose wrapper skips samples (4 per batch), not batches.
    c = DataLoader(IndexDataset(16), sampler=EveryThirdFirst(16), batch_size=4)
    return {"a": pk_loader(size=80), "b": pk_loader(size=32, seed=2), "c": c}


def two_loaders_max_size() -> CombinedLoader:
    return CombinedLoader(two_loaders(), mode="max_size")


class EstimatesSteps(WeightRecorder):
    """Reads ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` (as for ``OneCycleLR``): Lightning
    then sets the train loader up before it restores the loops of the checkpoint it resumes."""

    def configure_optimizers(self) -> Any:
        self.facts["estimated_steps"] = self.trainer.estimated_stepping_batches
        return super().configure_optimizers()


class EstimatesStepsInSetup(WeightRecorder):
    """Reads ``trainer.estimated_stepping_batches`` in its ``setup`` hook: Lightning then sets the train loader up
    before the strategy's setup and before it loads the checkpoint it resumes."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.facts["estimated_steps"] = self.trainer.estimated_stepping_batches


class EstimatesStepsOnFitStart(WeightRecorder):
    """Reads ``trainer.estimated_stepping_batches`` in ``on_fit_start``: after the strategy's setup, still before
    Lightning restores the loops of the checkpoint it resumes."""

    def on_fit_start(self) -> None:
        self.facts["estimated_steps"] = self.trainer.estimated_stepping_batches


def loader_with_workers() -> Any:
    return pk_loader(size=96, num_workers=1)


class UserDealt(pl.LightningDataModule):
    """A training loader dealt by its user (after the process group exists), read by a worker process."""

    def train_dataloader(self) -> Any:
        return patch_dataloader_to_ddp(pk_loader(size=96, num_workers=1))


class UserBatched(pl.LightningDataModule):
    """A training loader its user dealt by index, batched by torch's plain BatchSampler given as batch_sampler=
    (the loader's own ``sampler`` is then a SequentialSampler), read by a worker process."""

    def train_dataloader(self) -> Any:
        dealt = DistributedSamplerWrapper(EveryThirdFirst(96), shuffle=True, seed=5)
        context = worker_context("lightning.pytorch")
        return DataLoader(IndexDataset(96), batch_sampler=BatchSampler(dealt, batch_size=8, drop_last=False),
                          num_workers=1, multiprocessing_context=context)


class UserSharded(pl.LightningDataModule):
    """A training loader its user sharded with torch's DistributedSampler, read by a worker process."""

    def __init__(self, batched: bool = False) -> None:
        super().__init__()
        self.batched = batched

    def train_dataloader(self) -> Any:
        dataset = IndexDataset(96)
        sampler, context = DistributedSampler(dataset, seed=3), worker_context("lightning.pytorch")
        if self.batched:  # the loader's own sampler is then a SequentialSampler
            return DataLoader(dataset, batch_sampler=BatchSampler(sampler, batch_size=8, drop_last=False),
                              num_workers=1, multiprocessing_context=context)
        return DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=1, multiprocessing_context=context)


def user_sharded_batched() -> UserSharded:
    return UserSharded(batched=True)


class SharedLoader(pl.LightningDataModule):
    """One loader its user dealt, kept and served for training and for validation."""

    def __init__(self) -> None:
        super().__init__()
        self.loader: Any = None

    def train_dataloader(self) -> Any:
        if self.loader is None:
            self.loader = patch_dataloader_to_ddp(pk_loader(size=96))
        return self.loader

    val_dataloader = train_dataloader


class CheckpointsInValidation(WeightRecorder):
    """Writes a checkpoint in the step of the first batch of the fit's first validation (Lightning resumes
    such a checkpoint by finishing that validation, with the loader it shares with training, before it
    trains again)."""

    def __init__(self, out_dir: str, path: Optional[Path]) -> None:
        super().__init__(out_dir)
        self.path = path

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.path is not None and not self.trainer.sanity_checking:
            self.trainer.save_checkpoint(self.path)
            self.path = None
        super().validation_step(batch, batch_idx)


def resume_on_a_used_trainer(out_dir: Path, run: str) -> None:
    """Resume ``stateful_first4`` (step 4) with ``max_steps=4``: no step left, and Lightning leaves its fit loop
    restarting; then, on the same Trainer, resume ``stateful_first`` (step 2), whose loaders ``configure_optimizers``
    sets up before the loops are restored: they must be prepared for it (steps 3 and 4 of ``stateful``)."""
    run_dir = out_dir / run
    run_dir.mkdir(exist_ok=True)
    model, checkpoints = EstimatesSteps(str(run_dir)), out_dir / "checkpoints"
    trainer = pl.Trainer(strategy=strategy("popen"), **trainer_kwargs(max_steps=4, max_epochs=1))
    for checkpoint in ("stateful_first4-step=4.ckpt", f"stateful_first-step={STATEFUL_STOP}.ckpt"):
        run_guarded(str(run_dir), lambda: trainer.global_rank,
                    lambda: trainer.fit(model, stateful_loader(), ckpt_path=checkpoints / checkpoint))


def fit_validating(out_dir: Path, run: str, ckpt_path: Optional[Path] = None) -> None:
    """The shared loader, validated every 2 training batches; the first run writes the mid-validation checkpoint."""
    run_dir = out_dir / run
    run_dir.mkdir(exist_ok=True)
    checkpoint = out_dir / "checkpoints" / "validating.ckpt" if ckpt_path is None else None
    model, data = CheckpointsInValidation(str(run_dir), checkpoint), SharedLoader()
    trainer = pl.Trainer(strategy=strategy("popen"), **trainer_kwargs(max_epochs=1, val_check_interval=2))
    run_guarded(str(run_dir), lambda: trainer.global_rank, lambda: trainer.fit(model, data, ckpt_path=ckpt_path))


def resume_then_reuse(out_dir: Path, run: str, ckpt_path: Path) -> None:
    """Resume a fit that has no step left, then train on the same loader in a fit that leaves loaders as given
    (``use_distributed_sampler=False``, so nothing prepares them), then validate with it: both read it whole."""
    run_dir = out_dir / run
    run_dir.mkdir(exist_ok=True)
    model, data = WeightRecorder(str(run_dir)), SharedLoader()
    trainer = pl.Trainer(strategy=strategy("popen"), **trainer_kwargs(max_steps=SHARED_STOP, max_epochs=1))
    run_guarded(str(run_dir), lambda: trainer.global_rank, lambda: trainer.fit(model, data, ckpt_path=ckpt_path))
    again = pl.Trainer(strategy=strategy("popen"), **trainer_kwargs(max_epochs=1, use_distributed_sampler=False,
                                                                    limit_val_batches=0))
    run_guarded(str(run_dir), lambda: again.global_rank, lambda: again.fit(model, data))
    run_guarded(str(run_dir), lambda: trainer.global_rank, lambda: trainer.validate(model, data))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    checkpoints = out / "checkpoints"
    limited = dict(max_epochs=3, limit_train_batches=LIMIT)
    limited_checkpoint = fit_interrupted(out, "limited", limited_loader, LIMITED_STOP, **limited)
    fit(out, "limited_resumed_with_workers", limited_loader_with_workers, ckpt_path=limited_checkpoint, **limited)
    fit_interrupted(out, "cycled", two_loaders, CYCLED_STOP, max_epochs=1)
    # Resumed with max_steps, Lightning goes on with the epoch; by epochs alone, with the next one. It counts the
    # rest of the epoch as one more epoch towards max_epochs: 12 steps are 2 epochs uninterrupted, 3 when resumed.
    ended_checkpoint = fit_interrupted(out, "ended_by_max_steps", curriculum_loader, ENDED_BY_MAX_STEPS,
                                       at_epoch_end=True, max_epochs=3, max_steps=12)
    fit(out, "ended_by_max_steps_resumed_by_epochs", curriculum_loader, ckpt_path=ended_checkpoint, max_epochs=2)
    # The same with a sampler that reshuffles per epoch: Lightning 2.3+ passes set_epoch one more than the epoch it
    # runs from then on; the rest must be dealt in the ended epoch's order, and later epochs in theirs, also
    # after a second resume from a checkpoint written inside the next epoch.
    reshuffled_checkpoint = fit_interrupted(out, "ended_reshuffled", reshuffled_loader, ENDED_BY_MAX_STEPS,
                                            at_epoch_end=True, max_epochs=3, max_steps=12)
    fit(out, "ended_reshuffled_reloading", reshuffled_loader, ckpt_path=reshuffled_checkpoint, max_epochs=3,
        max_steps=12, reload_dataloaders_every_n_epochs=1)  # each epoch's set-up deals what its loop runs
    fit(out, "ended_reshuffled_again", reshuffled_loader, ckpt_path=reshuffled_checkpoint, stop_at=RESHUFFLED_AGAIN,
        max_epochs=3)
    fit(out, "ended_reshuffled_again_resumed", reshuffled_loader, max_epochs=3, max_steps=12,
        ckpt_path=checkpoints / f"ended_reshuffled_again-step={RESHUFFLED_AGAIN}.ckpt")
    grown_checkpoint = fit_interrupted(out, "grown", growing_loader, GROWN_STOP, max_epochs=3,
                                       reload_dataloaders_every_n_epochs=1)
    fit(out, "grown_again", growing_loader, ckpt_path=grown_checkpoint, stop_at=GROWN_AGAIN, max_epochs=3,
        reload_dataloaders_every_n_epochs=1)
    fit(out, "grown_again_resumed", growing_loader, ckpt_path=checkpoints / f"grown_again-step={GROWN_AGAIN}.ckpt",
        max_epochs=3, reload_dataloaders_every_n_epochs=1)
    fit(out, "grown_stale", growing_loader, max_epochs=3)  # Lightning reads its length once
    fit_interrupted(out, "grown_validated", GrownValidated, GROWN_STOP, in_validation=True, max_epochs=3,
                    reload_dataloaders_every_n_epochs=1, val_check_interval=0.5, model_class=LogsValidation)
    fit_interrupted(out, "grown_hooked", GrownByHook, GROWN_STOP, max_epochs=3, reload_dataloaders_every_n_epochs=1)
    fit(out, "unsized", unsized_loader, max_epochs=1)
    fit(out, "grown_beside", growing_beside_a_longer_one, max_epochs=3)  # b never limits the epoch: nothing lost
    fit(out, "grown_late", told_loader, max_epochs=3, reload_dataloaders_every_n_epochs=1,
        callbacks=[RaisesLevelAtEpochStart()])
    fit_interrupted(out, "sized", two_loaders_max_size, CYCLED_STOP, max_epochs=1)
    fit_interrupted(out, "user_dealt", UserDealt, USER_DEALT_STOP, max_epochs=2)
    fit_interrupted(out, "user_batched", UserBatched, USER_DEALT_STOP, max_epochs=2)
    fit_interrupted(out, "estimating", loader_with_workers, USER_DEALT_STOP, max_epochs=2, model_class=EstimatesSteps)
    early_checkpoint = fit_interrupted(out, "early", loader_with_workers, USER_DEALT_STOP, max_epochs=2,
                                       model_class=EstimatesStepsInSetup)
    fit_interrupted(out, "user_sharded", UserSharded, USER_SHARDED_STOP, max_epochs=2)
    fit_interrupted(out, "user_sharded_batched", user_sharded_batched, USER_SHARDED_STOP, max_epochs=2)
    fit(out, "shared_first", SharedLoader, stop_at=SHARED_STOP, max_epochs=1)
    resume_then_reuse(out, "shared_resumed", checkpoints / f"shared_first-step={SHARED_STOP}.ckpt")
    fit_validating(out, "validating")
    fit_validating(out, "validating_resumed", checkpoints / "validating.ckpt")
    stateful_checkpoint = fit_interrupted(out, "stateful", stateful_loader, STATEFUL_STOP, max_epochs=1)
    fit(out, "stateful_early_resumed", stateful_loader, ckpt_path=stateful_checkpoint, max_epochs=1,
        model_class=EstimatesStepsInSetup)
    fit(out, "stateful_estimating_resumed", stateful_loader, ckpt_path=stateful_checkpoint, max_epochs=1,
        model_class=EstimatesSteps)
    fit(out, "generator_first", batch_generator, stop_at=2, max_epochs=1)
    fit(out, "generator_resumed", batch_generator, ckpt_path=checkpoints / "generator_first-step=2.ckpt", max_epochs=1)
    fit(out, "generator_early_resumed", batch_generator, ckpt_path=checkpoints / "generator_first-step=2.ckpt",
        max_epochs=1, model_class=EstimatesStepsInSetup)
    generator_checkpoint = checkpoints / "generator_cycled_first-step=2.ckpt"
    fit(out, "generator_cycled_first", cycled_with_a_generator, stop_at=2, max_epochs=1, limit_train_batches=12)
    for run, model_class in (("resumed", WeightRecorder), ("estimating_resumed", EstimatesSteps),
                             ("early_resumed", EstimatesStepsInSetup)):
        fit(out, f"generator_cycled_{run}", cycled_with_a_generator, ckpt_path=generator_checkpoint, max_epochs=1,
            limit_train_batches=12, model_class=model_class)
    for run, model_class in (("early_own_optimizers_resumed", EstimatesStepsInSetup),
                             ("own_optimizers_resumed", WeightRecorder)):
        fit(out, run, loader_with_workers, ckpt_path=early_checkpoint, strategy_class=RestoresItsOwnOptimizers,
            max_epochs=2, model_class=model_class)
    fit(out, "stateful_first4", stateful_loader, stop_at=4, max_epochs=1)
    resume_on_a_used_trainer(out, "stateful_used_trainer")
    fit_interrupted(out, "stateful_mixed", stateful_and_plain, STATEFUL_STOP, max_epochs=1, model_class=EstimatesSteps)
    streams = dict(max_epochs=2, model_class=EstimatesStepsInSetup)
    streams_checkpoint = fit_interrupted(out, "stateful_streams", stateful_stream, USER_DEALT_STOP, **streams)
    fit_interrupted(out, "stateful_streams_reloaded", stateful_streams, USER_DEALT_STOP,
                    reload_dataloaders_every_n_epochs=1, **streams)
    fit(out, "stateful_streams_on_fit_start_resumed", stateful_stream, max_epochs=2, ckpt_path=streams_checkpoint,
        model_class=EstimatesStepsOnFitStart)
