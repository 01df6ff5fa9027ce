"""Every use of Lightning's private API, in one place.

Checked against lightning 2.2.0 to 2.6.6 (``LIGHTNING_CHECKED``); ``tests/test_compat.py`` fails loudly when
an installed Lightning no longer has what these functions rely on. Nothing else in the package touches an
underscored Lightning name.
"""
from __future__ import annotations

import copy
import inspect
import os
import tempfile
import traceback
import weakref
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, NamedTuple, Optional, cast

from lightning.fabric.strategies.launchers.multiprocessing import _disable_module_memory_sharing
from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher
from lightning.pytorch.strategies.launchers.multiprocessing import _GlobalStateSnapshot, _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs
from torch.multiprocessing import ProcessRaisedException
from torch.utils.data import BatchSampler, DataLoader
from typing_extensions import override

from lightning_ddp_ext._pickling import PICKLING_ERRORS, unpicklable_path
from lightning_ddp_ext.dataloader import is_sharded

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

LIGHTNING_CHECKED = (">=2.2.0", "<=2.6.6")
_USER_FLAG = "_lightning_ddp_ext_user_flag"  # where the user's use_distributed_sampler is kept


def take_over_sampler_replacement(trainer: "pl.Trainer", take_over: bool = True) -> bool:
    """Stop (or, with ``take_over=False``, restore) Lightning's own sampler replacement.

    Returns whether the user allowed sampler replacement at all (the Trainer's ``use_distributed_sampler``).
    Lightning replaces samplers in ``_DataConnector._prepare_dataloader``, which runs *before*
    ``Strategy.process_dataloader`` and there either raises for custom batch samplers or re-instantiates
    them. Its only switch is the accelerator connector's ``use_distributed_sampler`` flag (the Trainer
    argument), read at every dataloader set-up, which follows ``Strategy.setup_environment`` in every trainer
    entry point (``Strategy.setup`` comes after the LightningModule's ``setup`` hook, which may set loaders
    up). The user's original value is kept on the connector.
    """
    connector = trainer._accelerator_connector
    if not hasattr(connector, _USER_FLAG):
        setattr(connector, _USER_FLAG, bool(connector.use_distributed_sampler))
    user_flag = bool(getattr(connector, _USER_FLAG))
    connector.use_distributed_sampler = user_flag and not take_over
    _leave_sharded_loaders_alone(trainer)
    return user_flag


def _leave_sharded_loaders_alone(trainer: "pl.Trainer") -> None:
    """Where Lightning still replaces samplers (predict), let it skip a loader that one of our wrappers deals
    already, as it skips one with torch's ``DistributedSampler``: it would shard the wrapper's share again and
    each rank would predict half of its share, silently (``patch_dataloader_to_ddp`` of a plain or an
    index-sampler loader). ``_DataConnector._requires_distributed_sampler`` is that test in 2.2 to 2.6; the
    instance attribute keeps Lightning's own answer for every other loader."""
    connector = trainer._data_connector
    if "_requires_distributed_sampler" in vars(connector):
        return
    requires = connector._requires_distributed_sampler

    def requires_unless_dealt(dataloader: DataLoader) -> bool:
        return bool(requires(dataloader)) and not is_sharded(dataloader)

    connector._requires_distributed_sampler = requires_unless_dealt  # type: ignore[method-assign]


@contextmanager
def configure_ddp_called_without_arguments(strategy: "DDPStrategy", adapter: Callable[[], None]) -> Iterator[None]:
    """Route ``DDPStrategy.setup``'s argument-less ``self.configure_ddp()`` call to ``adapter``.

    Our ``configure_ddp(model, device_ids)`` has the DDPPlugin signature, so Lightning's call would fail.
    An instance attribute shadows the method for the duration of ``setup`` only, which keeps the rest of
    Lightning's ``setup`` (SyncBatchNorm, precision, optimizers, model averaging) as it is.
    """
    strategy.__dict__["configure_ddp"] = adapter
    try:
        yield
    finally:
        strategy.__dict__.pop("configure_ddp", None)


def ddp_kwargs(strategy: "DDPStrategy") -> Dict[str, Any]:
    """The keyword arguments a DDPStrategy forwards to its model wrapper."""
    return strategy._ddp_kwargs


def process_group_timeout(strategy: "DDPStrategy") -> Optional[timedelta]:
    return strategy._timeout


def requested_process_group_backend(strategy: "DDPStrategy") -> Optional[str]:
    return strategy._process_group_backend


def set_process_group_backend(strategy: "DDPStrategy", backend: str) -> None:
    """Record the backend where ``DDPStrategy.process_group_backend`` reads it."""
    strategy._process_group_backend = backend


def comm_hook_arguments(strategy: "DDPStrategy") -> tuple[Optional[object], Optional[Callable], Optional[Callable]]:
    """``(ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper)`` as given to the constructor."""
    return strategy._ddp_comm_state, strategy._ddp_comm_hook, strategy._ddp_comm_wrapper


def _running_loop(trainer: "pl.Trainer", stage: RunningStage) -> Any:
    """The loop that runs ``stage`` now, chosen by the trainer function: ``Trainer.val_dataloaders`` prefers
    the fit loop's validation loaders even during a later ``validate()`` on the same trainer."""
    if stage == RunningStage.TRAINING:
        return trainer.fit_loop
    if stage == RunningStage.TESTING:
        return trainer.test_loop
    if trainer.state.fn == TrainerFn.FITTING:  # validation or sanity check within fit
        return trainer.fit_loop.epoch_loop.val_loop
    return trainer.validate_loop


def current_loaders(trainer: "pl.Trainer", stage: RunningStage) -> List[object]:
    """The loaders the running ``stage`` iterates now, as processed by the strategy, flattened in loader order."""
    combined = _running_loop(trainer, stage)._combined_loader
    return [] if combined is None else list(combined.flattened)


def training_batches_read(trainer: "pl.Trainer") -> Optional[List[float]]:
    """How many batches of each training loader (in :func:`current_loaders` order) the fit loop counted when it
    set them up (their lengths under ``limit_train_batches``); None before."""
    combined = trainer.fit_loop._combined_loader
    limits = None if combined is None else getattr(combined, "limits", None)
    return None if limits is None else [float(limit) for limit in limits]


def training_batches_per_loader(trainer: "pl.Trainer", lengths: List[float]) -> Optional[List[float]]:
    """How many batches the fit loop would count for training loaders of ``lengths`` (in :func:`current_loaders`
    order) if it set them up now, under ``limit_train_batches``; None where it would refuse a length (a fraction
    of less than one batch)."""
    try:
        limit = trainer.limit_train_batches
        return [float(_parse_num_batches(RunningStage.TRAINING, length, limit)) for length in lengths]
    except MisconfigurationException:
        return None


def training_epoch_batches(trainer: "pl.Trainer", per_loader: List[float]) -> float:
    """The batches of a training epoch over loaders counted ``per_loader``: the longest one's, or the shortest one's
    in mode "min_size"."""
    return min(per_loader) if training_loader_mode(trainer) == "min_size" else max(per_loader)


class EvaluationCounts(NamedTuple):
    """What the running validation or test loop has counted: batches per loader (its own count, summed over a
    fit's validation runs, not in the sanity check) and completed steps of this run (restored on a restart)."""

    per_loader: Dict[int, int]
    steps: int


NO_COUNTS = EvaluationCounts({}, 0)


def evaluation_counts(trainer: "pl.Trainer") -> EvaluationCounts:
    """The running validation or test loop's counts now. Read at a run's start (after the loop's reset) and
    subtracted by :func:`evaluated_batches`: neither count starts at 0 with every run."""
    stage = RunningStage.TESTING if trainer.testing else RunningStage.VALIDATING
    loop = _running_loop(trainer, stage)
    per_loader = dict(getattr(loop, "_seen_batches_per_dataloader", None) or {})
    return EvaluationCounts(per_loader, int(loop.batch_progress.current.completed))


def evaluated_batches(trainer: "pl.Trainer", dataloader_idx: int, at_start: EvaluationCounts) -> Optional[int]:
    """How many batches of evaluation loader ``dataloader_idx`` the running validation or test has finished, or
    None when that is not known: inside a batch (its count is not updated yet), or with a step that takes the
    ``dataloader_iter`` (it may read any number of batches per step). ``at_start``: what
    :func:`evaluation_counts` said when this run started. The sanity check runs
    ``trainer.num_sanity_val_batches`` of each loader.

    A ``CombinedLoader`` in mode "max_size" or "min_size" steps all its loaders together (a limit only shortens
    the run), and the loop counts those steps under loader 0 alone, and not in the sanity check: every loader
    is then counted the run's steps, which the caller caps by what the loader yielded (in "max_size" a shorter
    loader runs out first). A run resumed inside validation starts with the steps done before the checkpoint
    counted, and runs only the rest: they are subtracted.
    """
    stage = RunningStage.TESTING if trainer.testing else RunningStage.VALIDATING
    loop = _running_loop(trainer, stage)
    if inside_evaluation_batch(trainer) or isinstance(getattr(loop, "_data_fetcher", None), _DataLoaderIterDataFetcher):
        return None
    if evaluation_combine_mode(trainer) not in (None, "sequential"):
        return evaluation_counts(trainer).steps - at_start.steps
    if trainer.sanity_checking:
        planned = trainer.num_sanity_val_batches
        count = planned[dataloader_idx] if 0 <= dataloader_idx < len(planned) else None
        return int(count) if isinstance(count, int) or (isinstance(count, float) and count.is_integer()) else None
    return evaluation_counts(trainer).per_loader.get(dataloader_idx, 0) - at_start.per_loader.get(dataloader_idx, 0)


def evaluation_combine_mode(trainer: "pl.Trainer") -> Optional[str]:
    """The mode of the running validation or test loop's ``CombinedLoader`` ("sequential" for plain loaders, which
    Lightning combines that way), or None when it has none."""
    stage = RunningStage.TESTING if trainer.testing else RunningStage.VALIDATING
    combined = getattr(_running_loop(trainer, stage), "_combined_loader", None)
    return getattr(combined, "_mode", None)


def inside_evaluation_batch(trainer: "pl.Trainer") -> bool:
    """Whether a validation or test batch is running: its batch-start hooks, its step or its batch-end hooks.

    The evaluation loop counts a batch "ready" before its start hooks and "completed" after its end hooks (the
    same in Lightning 2.2 and 2.6), so the two differ exactly while a batch runs. Epoch hooks and Lightning's
    own barrier when it reloads loaders run outside any batch. A batch that raised is never completed: once
    the trainer is no longer running (Lightning's exception handling, a checkpoint saved by
    ``OnExceptionCheckpoint``) no batch counts as running. The counts also stay unequal until the loop's next
    reset, so callers only ask between the evaluation's start and end hooks.
    """
    if trainer.state.status != TrainerStatus.RUNNING:
        return False
    if trainer.testing:
        stage = RunningStage.TESTING
    elif trainer.validating or trainer.sanity_checking:
        stage = RunningStage.VALIDATING
    else:
        return False
    progress = _running_loop(trainer, stage).batch_progress.current
    return bool(progress.ready > progress.completed)


def rebuild_dataloader(original: DataLoader, sharded: DataLoader) -> DataLoader:
    """``original``'s own class, built again with the sampling arguments of ``sharded``.

    For DataLoader subclasses (an ``__iter__`` of their own, extra arguments), which the strategy has the
    dataloader module build as a plain DataLoader first. The constructor arguments come from Lightning's capture
    of them (loaders made in a ``*_dataloader`` hook) or from the instance's attributes, as in Lightning's own
    sampler replacement;
    the sampler or batch sampler is the one ``sharded`` holds. Lightning's resolution of the sampler arguments
    is given a copy without a batch sampler, so it never re-instantiates the user's batch sampler.

    Raises:
        TypeError: the class cannot be rebuilt this way; the message says what to change.
    """
    batch_sampler = sharded.batch_sampler
    sampling: Dict[str, Any]
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:  # a dealt batch sampler
        sampling = {"batch_sampler": batch_sampler, "sampler": None, "batch_size": 1}
        sampling.update(shuffle=False, drop_last=False)
    else:
        sampling = {"sampler": sharded.sampler, "batch_sampler": None, "shuffle": False}
        sampling.update(batch_size=sharded.batch_size, drop_last=sharded.drop_last)
    view = object.__new__(type(original))
    view.__dict__.update(vars(original))
    view.__dict__["batch_sampler"] = None
    if "__pl_saved_kwargs" in view.__dict__:  # Lightning updates these in place: keep the user's loader as it is
        view.__dict__["__pl_saved_kwargs"] = dict(view.__dict__["__pl_saved_kwargs"])
    cls = type(original).__name__
    try:
        args, kwargs = _get_dataloader_init_args_and_kwargs(view, sharded.sampler)
        positional = list(getattr(original, "__pl_saved_arg_names", ()))[: len(args)]
        named = tuple(sampling.pop(name, value) for name, value in zip(positional, args))
        args = named + tuple(args[len(positional) :])
        rebuilt = _reinstantiate_wrapped_cls(original, *args, **{**kwargs, **sampling})
    except (MisconfigurationException, TypeError, ValueError) as error:
        raise TypeError(
            f"{cls} is a DataLoader subclass, so each rank's share is loaded by a new {cls} built with a sharded"
            f" sampler, and building it failed: {error} Let {cls}.__init__ accept DataLoader's sampler,"
            " batch_sampler, batch_size, shuffle and drop_last arguments and pass them on (**kwargs is enough),"
            " or shard the loader yourself and pass Trainer(use_distributed_sampler=False)."
        ) from error
    return rebuilt


class _LaunchingProcess(NamedTuple):
    """What a rank started by ``spawn`` shares with the process that launched it, for ``forkserver`` ranks."""

    environ: Dict[str, str]
    global_states: _GlobalStateSnapshot

    def restore(self) -> None:
        for name in set(os.environ) - set(self.environ):
            del os.environ[name]
        os.environ.update(self.environ)
        self.global_states.restore()


class _Launcher(_MultiProcessingLauncher):
    """Lightning's spawn/fork/forkserver launcher, whose errors name their cause.

    - A pickling error names the object that cannot be pickled. The launcher pickles the trainer and the
      arguments of ``fit``/``validate``/... for every rank; pickle only says ``cannot pickle '_thread.lock'
      object``. The arguments are searched for the innermost object that fails; if none is found the error is
      raised unchanged.
    - The error raised is the one of the rank that failed first. torch.multiprocessing reports the first
      process to *exit*; when one rank raises, the others fail in their next collective ("Connection closed by
      peer") and one of them may well exit first, which hid the cause. Each failing rank records its error in a
      folder the launching process made, before it exits and closes its connections; the first record is made
      atomically, and the launching process raises that one.
    - On CPU, ``forkserver`` ranks get a model of their own. Both ``spawn`` and ``forkserver`` send the model
      through torch's pickler, which moves CPU tensors to shared memory: every rank then trains the *same*
      parameters, and each optimizer step is applied once per rank (silently wrong weights, which differ from
      run to run). Lightning copies the module's tensors in each rank for ``spawn`` only; this does it for
      ``forkserver`` too, for the modules passed to the call and the one attached to the trainer.
    - ``forkserver`` ranks get the launching process's environment variables, torch flags and random states,
      as ``spawn`` ranks do. A forkserver rank is a fork of a server started once, at the first launch: it had
      that launch's environment (a later ``seed_everything``'s ``PL_GLOBAL_SEED`` did not reach it) and no
      flags (Lightning sends those for ``spawn`` only: ``Trainer(deterministic=True)`` did not reach it).

    A launch that succeeds costs a temporary folder. (A class, not patched methods: the launcher is pickled
    along with the trainer.)
    """

    _failures: Optional[str] = None  # the records' folder, during a launch
    _forkserver_start: Optional[_LaunchingProcess] = None  # what forkserver ranks take over, during a launch

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        with tempfile.TemporaryDirectory(prefix="lightning_ddp_ext-failures-") as failures:
            self._failures = failures
            if self._start_method == "forkserver":
                self._forkserver_start = _LaunchingProcess(dict(os.environ), _GlobalStateSnapshot.capture())
            try:
                return super().launch(function, *args, trainer=trainer, **kwargs)
            except PICKLING_ERRORS as error:
                named = self._naming_unpicklable(error, function, args, kwargs)
                if named is error:
                    raise
                raise named from error
            except ProcessRaisedException as error:
                first = _first_failure(failures, error, self.procs)
                if first is error:
                    raise
                raise first from None
            finally:
                self._failures = None
                self._forkserver_start = None

    def _naming_unpicklable(
        self, error: Exception, function: Callable, args: tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> Exception:
        """``error`` rewritten to name the innermost argument that cannot be pickled; ``error`` if none is found."""
        named = dict(zip(inspect.signature(function).parameters, args), **kwargs)
        culprit = next((path for key, value in named.items() if (path := unpicklable_path(value, key))), None)
        if culprit is None:
            return error
        return type(error)(
            f"{culprit} cannot be pickled, which start_method={self._start_method!r} needs to send it to every"
            f" rank: {error}. Make it picklable (create the lock, file or generator lazily, e.g. in __iter__),"
            " or use strategy='ddp_custom_sampler' (start_method='popen'), which starts the ranks as scripts"
            " and pickles nothing."
        )

    @override
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        """Lightning's function run in each started process, which records the error it fails with. A forkserver
        rank first takes over the launching process's state, and on CPU a copy of its modules of its own."""
        try:
            if self._forkserver_start is not None:  # set by launch() for forkserver ranks
                self._forkserver_start.restore()
                if isinstance(self._strategy.accelerator, CPUAccelerator):
                    trainer, _, function_args, function_kwargs = args[:4]  # as Lightning passes them (test_compat)
                    _unshare_module_memory(trainer, function_args, function_kwargs)
            super()._wrapping_function(process_idx, *args, **kwargs)
        except Exception:  # as torch.multiprocessing's wrapper, which reports these
            _record_failure(self._failures, process_idx, traceback.format_exc())
            raise


def _unshare_module_memory(trainer: Optional["pl.Trainer"], function_args: Any, function_kwargs: Any) -> None:
    """Give this rank its own copy of the tensors of the modules it was sent (as Lightning does for ``spawn``
    on CPU): those passed to the trainer's call, and the module attached to the trainer, which ``validate()``
    and the like use when given no model."""
    _disable_module_memory_sharing((function_args, function_kwargs))
    attached = trainer.lightning_module if trainer is not None else None
    if attached is not None and any(tensor.is_shared() for tensor in (*attached.parameters(), *attached.buffers())):
        _disable_module_memory_sharing(attached)


_FIRST_FAILURE = "first"


def _record_failure(folder: Optional[str], process_idx: int, trace: str) -> None:
    """Write ``trace`` to ``folder``; it becomes the folder's first failure unless another process's already is.

    The record is written whole under a name of its own, then hard-linked as the first failure: the link is
    made once, atomically, whichever process comes first. Never raises: the process's own error goes on."""
    if folder is None:
        return
    record = os.path.join(folder, f"process{process_idx}")
    try:
        with open(record, "w", encoding="utf-8") as file:
            file.write(f"{process_idx}\n{trace}")
        os.link(record, os.path.join(folder, _FIRST_FAILURE))
    except OSError:  # another process was first (FileExistsError), or the folder is gone
        pass


def _first_failure(folder: str, reported: ProcessRaisedException, processes: List[Any]) -> ProcessRaisedException:
    """The error of the process that failed first, as torch.multiprocessing raises it; ``reported`` itself when it
    is that one, or when no process recorded a failure."""
    try:
        index_text, _, trace = Path(folder, _FIRST_FAILURE).read_text(encoding="utf-8").partition("\n")
        index = int(index_text)
    except (OSError, ValueError):
        return reported
    if index == reported.error_index or not 0 <= index < len(processes):
        return reported
    consequence = reported.msg.strip().splitlines()[-1] if reported.msg.strip() else type(reported).__name__
    message = (
        f"\n\n-- Process {index} failed first, with the following error:\n{trace}"
        f"\n-- Process {reported.error_index} failed after it, most likely because of it, and exited first:"
        f" {consequence}\n"
    )
    return ProcessRaisedException(message, index, processes[index].pid)


def use_clear_error_launcher(strategy: "DDPStrategy") -> None:
    """Swap the spawn/fork/forkserver launcher ``DDPStrategy._configure_launcher`` made for :class:`_Launcher`,
    whose errors name an unpicklable object, and the rank that failed first."""
    launcher = strategy._launcher
    if type(launcher) is _MultiProcessingLauncher:
        strategy._launcher = _Launcher(strategy, start_method=launcher._start_method)


def kill_launched_ranks(strategy: "DDPStrategy") -> int:
    """SIGKILL the ranks that Lightning's popen launcher started from this process; return how many were alive.

    Only the process that launched (local rank 0) has any. Lightning's ``_SubprocessScriptLauncher`` kills
    them on Ctrl+C only; when rank 0 fails otherwise, a rank that is not inside a collective (a deadlocked
    DataLoader worker, a long step) would outlive it, orphaned.
    """
    launcher = strategy._launcher
    if not isinstance(launcher, _SubprocessScriptLauncher):
        return 0
    children = list(launcher.procs)
    # Lightning's child-process observer thread watches this very list, and SIGKILLs this process too when it
    # sees a child that died: emptied first, it lets this process report its own error.
    launcher.procs.clear()
    alive = [process for process in children if process.poll() is None]
    for process in alive:
        process.kill()
    for process in alive:
        process.wait()
    return len(alive)


def _restored_progress(trainer: "pl.Trainer") -> Optional[tuple[Any, Any]]:
    """The fit loop's ``(epoch progress, batch progress)`` as the checkpoint ``fit`` resumes restores them; None
    when it does not resume.

    Lightning loads the checkpoint before the strategy's setup but restores the loops after it, and a
    ``configure_optimizers`` that reads ``trainer.estimated_stepping_batches`` (as for ``OneCycleLR``) sets the
    train loader up in between (and keeps it): the progress is then read from the loaded checkpoint. Read while the
    train loader is being set up, before ``FitLoop.reset`` interprets the restored progress.
    """
    fit_loop = trainer.fit_loop
    epochs, batches = fit_loop.epoch_progress, fit_loop.epoch_loop.batch_progress
    if fit_loop.restarting:
        return epochs, batches
    loaded = getattr(getattr(trainer, "_checkpoint_connector", None), "_loaded_checkpoint", None) or {}
    state = (loaded.get("loops") or {}).get("fit_loop") if trainer.state.fn == TrainerFn.FITTING else None
    if not state or "epoch_progress" not in state or "epoch_loop.batch_progress" not in state:
        return None
    epochs, batches = copy.deepcopy(epochs), copy.deepcopy(batches)
    epochs.load_state_dict(state["epoch_progress"])
    batches.load_state_dict(state["epoch_loop.batch_progress"])
    return epochs, batches


def _restarted_epoch(trainer: "pl.Trainer", restored: Optional[tuple[Any, Any]]) -> Optional[tuple[int, int, Any]]:
    """``(epoch, trained epoch, its batch progress)`` when the ``restored`` progress (see
    :func:`_restored_progress`) is inside an epoch, else None. ``epoch`` is the number Lightning passes to
    ``set_epoch`` when it goes on; ``trained epoch`` the number of the epoch whose batches were trained.

    That is an epoch started but not processed (a checkpoint written during it), or one whose epoch-end hooks
    ran before its last batch: ``max_steps`` or ``trainer.should_stop`` ended the fit there, and the checkpoint
    ``ModelCheckpoint`` writes then is processed but not completed. Lightning goes on with the epoch's remaining
    batches from either (from the same shape after the last batch, with the next epoch); from the second only when
    the resumed fit sets ``max_steps``: by ``max_epochs`` alone it starts the next epoch (2.6 does not even mark
    its loops as restarting then, so ``_restored_progress`` finds nothing to resume; see
    :func:`epoch_left_unfinished`). For the second, fit loops with restart stages pass the processed count to
    ``set_epoch`` (one more than the ended epoch's: they count its rest as an epoch of its own), older ones (2.2)
    the completed one (the ended epoch's)."""
    if restored is None:
        return None
    epochs: Any = restored[0].current  # a _ProcessedTracker, typed as its base class
    if epochs.started != epochs.ready:
        return None
    if epochs.processed == epochs.started - 1:
        return int(epochs.processed), int(epochs.processed), restored[1]
    if _stopped_inside_epoch(restored):
        stages = hasattr(trainer.fit_loop, "resumed_on_epoch_end")
        return int(epochs.processed if stages else epochs.completed), int(epochs.completed), restored[1]
    return None


def epoch_left_unfinished(trainer: "pl.Trainer") -> Optional[tuple[int, int]]:
    """``(epoch, batches trained in it)`` when ``fit`` resumes by ``max_epochs`` alone (``max_steps`` unset)
    from the checkpoint of a fit that stopped before the epoch's last batch; None otherwise. Read as
    :func:`mid_epoch_resume` reads the progress, while the training loaders are set up.

    A fit that ``trainer.should_stop`` (a ``Timer``, ``max_time``, ``EarlyStopping``) or ``max_steps`` ends inside
    an epoch still runs the epoch-end hooks, where ``ModelCheckpoint`` writes a checkpoint that is processed but
    not completed (see :func:`_restarted_epoch`). Resumed with ``max_steps`` set, Lightning goes on with the
    epoch's remaining batches; without it, it starts the next epoch, and they are never trained, with any
    strategy. An epoch that ``limit_train_batches`` ended has the same shape: compare the count returned with
    ``trainer.num_training_batches``. Lightning does not mark its loops as restarting from such a checkpoint
    (2.6's "resumed on epoch end"), so the progress is read from them as restored, before the fit loop's reset."""
    fit_loop = trainer.fit_loop
    if trainer.ckpt_path is None or fit_loop.max_steps != -1:
        return None
    restored = _restored_progress(trainer) or (fit_loop.epoch_progress, fit_loop.epoch_loop.batch_progress)
    if not _stopped_inside_epoch(restored):
        return None
    return int(restored[0].current.completed), int(restored[1].current.completed)


def _stopped_inside_epoch(restored: tuple[Any, Any]) -> bool:
    """Whether the restored ``(epoch progress, batch progress)`` is of an epoch whose epoch-end hooks ran before its
    last batch (``max_steps`` or ``trainer.should_stop`` ended the fit inside it): processed, not completed."""
    epochs: Any = restored[0].current  # a _ProcessedTracker, typed as its base class
    ended = epochs.started == epochs.ready == epochs.processed and epochs.completed == epochs.processed - 1
    return ended and not _last_batch_done(restored[1])


def mid_epoch_resume(trainer: "pl.Trainer") -> Optional[tuple[int, int]]:
    """``(epoch, batches already trained in it)`` when ``fit`` resumes from a mid-epoch checkpoint, else None.
    The epoch is the one whose batches were trained (see :func:`_restarted_epoch`): the rest is dealt in its order.

    Its batches counted as processed ran their optimizer step before the checkpoint (a checkpoint written in
    ``on_train_batch_end`` counts its own batch as processed but not yet completed). A checkpoint written in the
    ``on_train_batch_end`` of the epoch's last batch (``limit_train_batches`` counts) is not mid-epoch: Lightning
    goes on with the next epoch, on the iterator it makes while setting up (see
    :func:`_goes_on_with_the_next_epoch`); one written after that batch's validation is, with every batch done
    (Lightning finishes the epoch without fetching one). Lightning
    versions without restart stages in their training epoch loop (2.2) re-run the batch whose
    ``on_train_batch_end`` wrote the checkpoint, in the middle of an epoch and at its end, with any sampler:
    the count returned is then the batches they count as completed.
    """
    restarted = _restarted_epoch(trainer, _restored_progress(trainer))
    if restarted is None or _goes_on_with_the_next_epoch(trainer, restarted[2]):
        return None
    progress = restarted[2].current
    # Lightning runs the epoch's batches it does not count as done. Loops with restart stages count the batch
    # whose on_train_batch_end wrote the checkpoint (processed, not yet completed); older ones (2.2) run it
    # again, so skipping it there would leave them one batch short: no epoch-end validation, no last step.
    restarts_on_batch_end = hasattr(trainer.fit_loop.epoch_loop, "restarted_on_train_batch_end")
    done = progress.processed if restarts_on_batch_end else progress.completed
    return restarted[1], int(done)


def restores_loader_position(trainer: "pl.Trainer", loader: object) -> bool:
    """Whether Lightning is about to restore ``loader``'s own position from the checkpoint it resumes.

    A loader with ``state_dict`` and ``load_state_dict`` (torchdata's ``StatefulDataLoader``, for example) is
    saved in the checkpoint by the fit loop, which loads its state back once the train loader is set up: the
    loader then skips the batches it had yielded by itself, so a sampler must not skip them too. A loader set up
    before the loops are restored (see :func:`_restored_progress`) is not, until :func:`restart_training_iterator`.
    """
    return pending_loader_states(trainer) and isinstance(loader, _Stateful)


def pending_loader_states(trainer: "pl.Trainer") -> bool:
    """Whether the fit loop holds loader states from the checkpoint it resumes that no set-up has loaded yet, and
    will load them (it does while it restarts: not after a checkpoint written once its epoch was complete)."""
    fit_loop = trainer.fit_loop
    return fit_loop.restarting and bool(getattr(fit_loop, "_combined_loader_states_to_load", None))


def reloads_training_loaders(trainer: "pl.Trainer") -> bool:
    """Whether the fit loop sets its training loaders up again when it starts (``reload_dataloaders_every_n_epochs``
    since the epoch it last did, which a loader set up before the checkpoint was loaded counts as 0)."""
    return bool(getattr(trainer.fit_loop, "_should_reload_train_dl", False))


def can_restart_training_iterator(trainer: "pl.Trainer") -> bool:
    """Whether :func:`restart_training_iterator` can run: this Lightning keeps the iterator where it looks."""
    fit_loop = trainer.fit_loop
    return getattr(fit_loop, "_data_fetcher", None) is not None and hasattr(fit_loop, "_load_combined_loader_states")


def restart_training_iterator(trainer: "pl.Trainer") -> None:
    """Make the fit loop's training iterator again, as its set-up does: load the restored states of stateful
    loaders, then iterate. A resumed fit's first epoch runs on the iterator the set-up made."""
    fit_loop = trainer.fit_loop
    fetcher = fit_loop._data_fetcher
    assert fetcher is not None, "can_restart_training_iterator says when there is one"
    fit_loop._load_combined_loader_states()
    iter(fetcher)


def training_loader_mode(trainer: "pl.Trainer") -> Optional[str]:
    """The mode of the fit loop's ``CombinedLoader`` ("max_size_cycle" unless its user chose another); None
    before the fit loop has combined its training loaders, which it does after processing each of them."""
    return getattr(getattr(trainer.fit_loop, "_combined_loader", None), "_mode", None)


def _last_batch_done(batches: Any) -> bool:
    """Whether the restored batch progress says the epoch's last batch ran its step: ``is_last_batch`` is set
    when that batch is fetched, so a checkpoint written during its step (``OnExceptionCheckpoint``) has it too,
    and Lightning re-runs that batch."""
    progress = batches.current
    return bool(batches.is_last_batch) and progress.processed == progress.started == progress.ready


def close_epoch_restored_after_its_last_batch(trainer: "pl.Trainer") -> Optional[tuple[int, int]]:
    """Have the training epoch loop start the coming epoch from its first batch when the checkpoint was written
    in the ``on_train_batch_end`` of an epoch's last batch (see :func:`_goes_on_with_the_next_epoch`); call
    after the fit loop's reset. Returns ``(batches of the restored epoch, batches known for the coming one)``
    when the coming one is known to be longer (where Lightning alone would have gone wrong), else None.

    From such a checkpoint the fit loop goes on with the next epoch, for which the training loaders are set up,
    while loops with restart stages reset the epoch loop's position only if its completed count reaches the
    number of batches, read from the coming epoch: when that epoch is longer (a curriculum growing through
    ``set_epoch``, or a ``train_dataloader`` hook that reads ``trainer.current_epoch`` when the loaders are
    set up again), the epoch loop kept the restored position, trained the coming epoch's first batches up to
    its length and ended it there. This does what the epoch loop does for an epoch of the same length, before
    a reload can change the length."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    batches = trainer.num_training_batches
    if not getattr(epoch_loop, "restarted_on_train_batch_end", False) or batches == float("inf"):
        return None
    if not _last_batch_done(epoch_loop.batch_progress):
        return None
    max_epochs, epochs = fit_loop.max_epochs, cast(Any, fit_loop.epoch_progress.current)  # a _ProcessedTracker
    if max_epochs is not None and 0 <= max_epochs <= epochs.processed:
        return None  # no epoch follows: the restored progress stays as it is
    if 0 <= fit_loop.max_steps <= trainer.global_step:
        return None
    restored = int(epoch_loop.batch_progress.current.completed) + 1  # counting the batch whose hook wrote it
    epoch_loop.batch_progress.increment_completed()
    epoch_loop.batch_progress.reset_on_run()
    epoch_loop.scheduler_progress.reset_on_run()
    epoch_loop.automatic_optimization.optim_progress.reset_on_run()
    epoch_loop.val_loop.batch_progress.total.reset()
    epoch_loop.reset_restart_stage()  # done: its reset must not count the restored batch again
    if fit_loop.restarted_mid_epoch:
        # The fit loop has moved its processed and completed epochs on, but while it restarts mid-epoch it would
        # neither start the coming epoch (ready, started) nor call on_train_epoch_start: a checkpoint written in
        # it would then say the epoch was done (resumed, it ran again), and epoch-start callbacks would miss it.
        fit_loop.reset_restart_stage()
    return (restored, int(batches)) if restored < batches else None


def _goes_on_with_the_next_epoch(trainer: "pl.Trainer", batches: Any) -> bool:
    """Whether Lightning goes on with the next epoch from the restored batch progress of a started epoch: from a
    checkpoint written in the ``on_train_batch_end`` of the epoch's last batch, on loops with restart stages.
    Loops without them (2.2) run that batch again first. From a checkpoint written after that hook (in the
    validation at the epoch's end), every version finishes the restored epoch first, with no batch left."""
    if not _last_batch_done(batches):
        return False
    progress = batches.current
    written_in_the_batch_hook = progress.completed == progress.processed - 1
    return written_in_the_batch_hook and hasattr(trainer.fit_loop.epoch_loop, "restarted_on_train_batch_end")


class TrainingEpochToDeal:
    """The epoch a training loader deals when Lightning's fit loop calls ``set_epoch(epoch)`` (see
    :func:`_restarted_epoch`): the loop's number, but one less while the fit loop's processed epochs run one
    ahead of its completed ones (``trainer.current_epoch``), as they do for the rest of a fit resumed from the
    checkpoint of a fit that ``max_steps`` ended inside an epoch, on loops with restart stages. Those loops pass
    the processed count, so a sampler that reshuffles per epoch would draw each epoch in the next one's order.
    Holds the trainer weakly; a copy that was pickled passes epochs through unchanged."""

    def __init__(self, trainer: "pl.Trainer") -> None:
        self._trainer: Optional[Callable[[], Optional["pl.Trainer"]]] = weakref.ref(trainer)

    def __call__(self, epoch: int) -> int:
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return epoch
        if not hasattr(trainer.fit_loop, "resumed_on_epoch_end"):  # loops without restart stages never run ahead
            return epoch
        progress: Any = trainer.fit_loop.epoch_progress.current
        return epoch - 1 if epoch == progress.processed == progress.completed + 1 else epoch

    def __getstate__(self) -> Dict[str, Any]:
        return {"_trainer": None}


def epoch_for_samplers(trainer: "pl.Trainer") -> int:
    """The epoch Lightning's fit loop passes to ``set_epoch`` at the start of the coming training epoch: the
    next one after a checkpoint written in the ``on_train_batch_end`` of an epoch's last batch (see
    :func:`_goes_on_with_the_next_epoch`)."""
    restored = _restored_progress(trainer)
    restarted = _restarted_epoch(trainer, restored)
    if restarted is not None:
        return restarted[0] + (1 if _goes_on_with_the_next_epoch(trainer, restarted[2]) else 0)
    epochs: Any = (restored[0] if restored is not None else trainer.fit_loop.epoch_progress).current
    return int(epochs.processed)


def fit_trains_an_epoch(trainer: "pl.Trainer") -> bool:
    """Whether the fit being set up will start a training epoch (whose start calls ``set_epoch``): not when a
    resumed or repeated fit has reached ``max_epochs`` or ``max_steps`` already. Read as
    :func:`epoch_for_samplers` reads the epoch, without the fit loop's ``done``, which logs why it is done."""
    fit_loop = trainer.fit_loop
    max_epochs = fit_loop.max_epochs
    if max_epochs is not None and max_epochs >= 0 and epoch_for_samplers(trainer) >= max_epochs:
        return False
    return not 0 <= fit_loop.max_steps <= _restored_global_step(trainer)


def _restored_global_step(trainer: "pl.Trainer") -> int:
    """The global step the fit goes on from: the loaded checkpoint's, before the loops are restored."""
    loaded = getattr(getattr(trainer, "_checkpoint_connector", None), "_loaded_checkpoint", None) or {}
    if not trainer.fit_loop.restarting and trainer.state.fn == TrainerFn.FITTING and "global_step" in loaded:
        return int(loaded["global_step"])
    return trainer.global_step


def comm_hook_states(wrapper: object, strategy: "DDPStrategy") -> List[object]:
    """The states of the communication hooks registered on a torch ``DistributedDataParallel`` ``wrapper``.

    torch keeps ``(hook, state)`` pairs in the wrapper's private ``_comm_hooks`` list, which also holds the
    hooks a ``configure_ddp`` override registered; where a torch has no such list, the strategy's own
    ``ddp_comm_state`` is all that is known.
    """
    hooks = getattr(wrapper, "_comm_hooks", None)
    if isinstance(hooks, list):
        return [state for _, state in hooks]
    state = comm_hook_arguments(strategy)[0]
    return [] if state is None else [state]


def restart_static_graph_delay(strategy: "DDPStrategy") -> None:
    """Let Lightning flush the first iteration of a newly built ``static_graph=True`` wrapper again.

    Lightning 2.6.0 on (#21251) calls the reducer's ``_delay_all_reduce`` after the first backward pass of a
    static-graph wrapper under manual optimization, once per strategy (``_pl_static_graph_delay_done``); a
    wrapper built during the fit has a first iteration of its own. Earlier versions have no such flag (and
    leave that first iteration's gradients unreduced on every wrapper).
    """
    if hasattr(strategy, "_pl_static_graph_delay_done"):
        strategy._pl_static_graph_delay_done = False
