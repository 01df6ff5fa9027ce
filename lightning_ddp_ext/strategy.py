"""``CustomDDP``: Lightning's DDPStrategy with DDPPlugin-style hooks and sampler dealing for custom samplers.

Lightning-facing glue only; the sampler work lives in ``samplers``/``dataloader``, reading what a dealt loader
holds (its wrapper, share sizes, what evaluation yielded) in ``_loader_shares``, the gradient work of a re-wrap
(averaging held gradients, clearing a comm hook's per-bucket state) in ``_gradients``, destroying the process
group at exit in ``_exit``, and every private Lightning access in ``_compat``.
"""
from __future__ import annotations

import collections.abc
import difflib
import gc
import inspect
import logging
import os
import weakref
import zlib
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from operator import attrgetter
from typing import Any, Dict, Generator, List, Literal, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.data import sized_len
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module, Parameter
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from typing_extensions import override

from lightning_ddp_ext import _compat, _exit
from lightning_ddp_ext._checks import check_flag, check_seed, check_shuffle_window
from lightning_ddp_ext._gradients import average_held_gradients, reaches_a_parameter, restart_per_bucket_state
from lightning_ddp_ext._loader_shares import (
    WRAPPER_TYPES,
    Wrapper,
    dealt_source,
    distributed_sampler_share,
    epoch_sampler,
    fewest_exact_batches,
    index_sampler,
    is_empty,
    items_in,
    record_yielded_in_evaluation,
    recorded_indices,
    samples_in_first_batches,
    whole_epoch_digest,
    wrapper_of,
)
from lightning_ddp_ext.consistency import (
    NOT_DEALT,
    NOT_DEALT_SOURCE,
    SequenceDigest,
    report_failure,
    verify_same_sequence,
)
from lightning_ddp_ext.dataloader import _patch as _patch_dataloader
from lightning_ddp_ext.dataloader import uses_default_sampler
from lightning_ddp_ext.samplers import DistributedBatchSamplerWrapper, _epoch_forwarded_to
from lightning_ddp_ext.sync import _PER_BATCH_HINT, _gather_in_order, _looks_per_batch, _not_samples_error

__all__ = ["CustomDDP", "process_group_backend_for"]

log = logging.getLogger(__name__)

#: Keys a ``distributed_sampler_kwargs`` override may return (``drop_last`` is read as ``pad=not drop_last``).
_SAMPLER_KWARGS = ("num_replicas", "rank", "shuffle", "shuffle_window", "seed", "pad", "drop_last")
#: The keys of those that Lightning's predict sharding can pass on to torch's samplers.
_PREDICT_SAMPLER_KWARGS = ("num_replicas", "rank", "seed", "drop_last")
#: What an overriding ``configure_ddp`` must do, for the errors that catch one that does not.
_CONFIGURE_DDP_CONTRACT = (
    "override it as configure_ddp(self, model, device_ids) and return the wrapped model, for example"
    " `return DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs)` (assigning self.model"
    " instead, as Lightning's later argument-less configure_ddp(self) does, is not enough)."
)
_requires_grad = attrgetter("requires_grad")


def _check_process_group_arguments(kwargs: Dict[str, Any], owner: str) -> None:
    """Refuse a ``timeout`` that is not a positive ``timedelta`` and a ``process_group_backend`` torch does not know.

    Lightning hands both to ``init_process_group`` unchecked, so a mistake (``timeout=1800``, a misspelt
    backend) failed only inside every rank, after the processes were started, with torch's message; an unknown
    backend with ``AssertionError: Unknown backend type``, which does not say what is known."""
    timeout = kwargs.get("timeout")
    if timeout is not None and not isinstance(timeout, timedelta):
        hint = f" timeout=timedelta(seconds={timeout!r})" if isinstance(timeout, (int, float)) else ""
        raise TypeError(
            f"{owner}(timeout={timeout!r}): the process-group timeout must be a datetime.timedelta, for example"
            f"{hint or ' timeout=timedelta(minutes=30)'} (from datetime import timedelta)."
        )
    if timeout is not None and timeout <= timedelta(0):
        raise ValueError(
            f"{owner}(timeout={timeout!r}): the process-group timeout must be positive (every rank would time out"
            " at once while meeting the others), for example timeout=timedelta(minutes=30)."
        )
    backend = kwargs.get("process_group_backend")
    if backend is None or not dist.is_available():
        return
    if not isinstance(backend, str):
        raise TypeError(
            f"{owner}(process_group_backend={backend!r}): give the backend's name as a string, for example 'gloo'."
        )
    known = [name for name in dist.Backend.backend_list if name != "undefined"]
    # "gloo", or per device as in init_process_group: "cpu:gloo,cuda:nccl"
    parts = backend.split(",")
    if len(parts) > 1 and not all(":" in part for part in parts):
        raise ValueError(
            f"{owner}(process_group_backend={backend!r}): several backends are given one per device, as"
            " 'device:backend' pairs, for example 'cpu:gloo,cuda:nccl'."
        )
    for part in parts:
        name = part.rpartition(":")[2].strip().lower()
        if name not in known:
            raise ValueError(
                f"{owner}(process_group_backend={backend!r}): torch.distributed knows no backend {name!r}. Known:"
                f" {', '.join(map(repr, known))} (or one per device, e.g. 'cpu:gloo,cuda:nccl'); a third-party"
                " backend must be registered with torch.distributed.Backend.register_backend before the strategy is"
                " made. Leave it out for NCCL on GPUs and Gloo on CPUs."
            )


def _refuse_keywords_ddp_does_not_take(kwargs: Dict[str, Any], owner: str) -> None:
    """Raise TypeError, naming the closest keyword, for one that torch's DistributedDataParallel does not take.

    The strategy hands the keywords it does not take itself to the model wrapper, which would raise only when
    the model is wrapped, in every rank, after the processes were started and the data set up."""
    accepted = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self"}
    for name in kwargs:
        if name in ("module", "device_ids"):
            raise TypeError(
                f"{owner} got {name}=..., which the strategy sets itself when it wraps the model (the module being"
                " trained, and the device of each rank, from the Trainer's accelerator and devices): leave it out."
            )
        if name not in accepted:
            known = accepted | set(inspect.signature(CustomDDP.__init__).parameters)
            known |= set(inspect.signature(DDPStrategy.__init__).parameters)
            close = difflib.get_close_matches(name, sorted(known - {"self", "kwargs", "module", "device_ids"}), n=1)
            raise TypeError(
                f"{owner} got an unexpected keyword argument {name!r}."
                + (f" Did you mean {close[0]!r}?" if close else "")
                + " Keywords that neither the strategy nor Lightning's DDPStrategy take go to torch's"
                " DistributedDataParallel, which does not take it either. (An override of configure_ddp may take"
                " keywords of its own from self.ddp_kwargs.)"
            )


def process_group_backend_for(device: torch.device, requested: Optional[str] = None) -> str:
    """The process-group backend for a root device: ``requested`` if given, NCCL on CUDA, Gloo otherwise."""
    if requested is not None:
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def _is_mean(reduce_op: Optional[Any]) -> bool:
    if isinstance(reduce_op, str):
        return reduce_op.lower() in ("mean", "avg")
    return reduce_op is not None and reduce_op == dist.ReduceOp.AVG


#: What `CustomDDP._prepare_first_epoch` sets for a training loader: the epoch Lightning sets on its sampler, the
#: epoch its wrapper deals (the same, but for the rest of an epoch that max_steps ended: see
#: `_compat._restarted_epoch`), and the ``(epoch, batches done)`` its wrapper skips; None for what it leaves alone.
_Plan = tuple[Optional[int], Optional[int], Optional[tuple[int, int]]]
_NOTHING_PLANNED: _Plan = (None, None, None)

#: Wrappers holding a resume skip that no training iteration has taken yet, with the id of the strategy that set
#: it (see `_prepare_first_epoch`).
_PENDING_SKIPS: "weakref.WeakKeyDictionary[Wrapper, int]" = weakref.WeakKeyDictionary()


def _sized_len_or_inf(loader: DataLoader) -> float:
    """``len(loader)``, or infinity for one without a length (over an IterableDataset), as Lightning counts it."""
    length = sized_len(loader)
    return float("inf") if length is None else float(length)


def _evaluation_limit(trainer: Trainer, stage: Optional[RunningStage]) -> Tuple[str, Union[int, float]]:
    """The ``limit_*_batches`` setting Lightning applies to the loaders of evaluation ``stage``: name and value."""
    stages = {RunningStage.TESTING: "limit_test_batches", RunningStage.PREDICTING: "limit_predict_batches"}
    setting = stages.get(stage, "limit_val_batches")  # type: ignore[arg-type]
    limit: Union[int, float] = getattr(trainer, setting, 1.0)
    return setting, limit


def _drop_skip(wrapper: Wrapper) -> None:
    """Drop a resume skip pending on ``wrapper``, if any."""
    wrapper.resume_within_epoch(0, None)
    _PENDING_SKIPS.pop(wrapper, None)


class CustomDDP(DDPStrategy):
    """DDP that deals any custom (batch) sampler out among ranks, with overridable DDPPlugin-style hooks.

    Lightning replaces samplers by re-instantiating them with a ``DistributedSampler`` inside, which fails
    for batch samplers with their own constructor and silently changes the ones that build batches
    themselves. This strategy turns that off and wraps the loader instead: the user's batch sampler is
    iterated whole on every rank and rank ``r`` keeps batches ``r, r + W, ...``
    (:class:`~lightning_ddp_ext.samplers.DistributedBatchSamplerWrapper`).

    Args:
        shuffle_batches_between_ranks: permute the batch order of training loaders before dealing (seeded by
            ``seed + epoch``), so a rank does not always get the same positions of the user's sequence.
        shuffle_window: with shuffling, permute within windows of ``shuffle_window * W`` batches and stream;
            None shuffles the whole epoch.
        pad_to_world_size: repeat batches from the start of the epoch so every rank gets the same count
            (False drops the incomplete last round).
        check_sampler_consistency: compare, across ranks, the lengths and a digest of what each rank's sampler
            yields, and raise before the first optimizer step when they differ (an unseeded sampler).
        seed: base seed of the shuffles and of ``DistributedSampler`` for default samplers. None (the default)
            takes the seed of ``seed_everything`` (``PL_GLOBAL_SEED``, else 0) as stock Lightning seeds its
            ``DistributedSampler``, but rank 0's, read when the trainer sets up: a seed that differs per rank
            must not deal overlapping shares.
        eval_mode: ``"pad"`` gives every rank the same number of validation/test batches, repeating a few
            (gather with :meth:`gather_in_order` to drop them); ``"exact"`` evaluates each sample once, so
            ranks run different numbers of steps: no collective may run inside ``validation_step``/
            ``test_step`` (e.g. ``self.log(..., on_step=True, sync_dist=True)``); one that goes through the
            strategy raises instead of hanging. A loader too short to give every rank a batch is refused.
        **kwargs: everything :class:`~lightning.pytorch.strategies.DDPStrategy` accepts, including keyword
            arguments for the model wrapper (``find_unused_parameters``, ``static_graph``, ...).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=CustomDDP(start_method="spawn"))
        >>> type(trainer.strategy).__name__
        'CustomDDP'
    """

    strategy_name = "ddp_custom_sampler"
    #: (registry name, constructor arguments) registered by :meth:`register_strategies`.
    registry_entries: tuple[tuple[str, Dict[str, Any]], ...] = (
        ("ddp_custom_sampler", {"start_method": "popen"}),
        ("ddp_custom_sampler_spawn", {"start_method": "spawn"}),
        ("ddp_custom_sampler_fork", {"start_method": "fork"}),
        ("ddp_custom_sampler_find_unused_parameters_true", {"start_method": "popen", "find_unused_parameters": True}),
    )

    def __init__(
        self,
        *,
        shuffle_batches_between_ranks: bool = False,
        shuffle_window: Optional[int] = None,
        pad_to_world_size: bool = True,
        check_sampler_consistency: bool = True,
        seed: Optional[int] = None,
        eval_mode: Literal["pad", "exact"] = "pad",
        **kwargs: Any,
    ) -> None:
        if eval_mode not in ("pad", "exact"):
            raise ValueError(f"eval_mode must be 'pad' or 'exact', got {eval_mode!r}.")
        # here, not in each rank at loader set-up
        shuffle_window = check_shuffle_window(shuffle_window, type(self).__name__)
        if seed is not None:
            check_seed(seed, type(self).__name__)
        _check_process_group_arguments(kwargs, type(self).__name__)
        super().__init__(**kwargs)
        if type(self).configure_ddp is CustomDDP.configure_ddp:  # an override may take keywords of its own
            _refuse_keywords_ddp_does_not_take(self.ddp_kwargs, type(self).__name__)
        self.eval_mode = eval_mode
        flag = partial(check_flag, owner=type(self).__name__)  # "no" is no False
        self.shuffle_batches_between_ranks = flag(shuffle_batches_between_ranks, "shuffle_batches_between_ranks")
        self.shuffle_window = shuffle_window
        self.pad_to_world_size = flag(pad_to_world_size, "pad_to_world_size")
        self.check_sampler_consistency = flag(check_sampler_consistency, "check_sampler_consistency")
        self.seed = seed
        self._global_seed: Optional[int] = None  # rank 0's PL_GLOBAL_SEED, read in setup_environment (_loader_seed)
        self._replace_samplers = True
        self._said_no_replacement = False
        self._evaluating = False  # between on_validation_start/on_test_start and the matching end hook
        self._counts_at_start = _compat.NO_COUNTS  # the evaluation loop's counts when the run started
        #: Per stage kind, the wrappers compared at the last check (see `_verify`).
        self._watched: Dict[str, List[Wrapper]] = {}
        self._verified_train_epoch: Optional[int] = None
        self._warned_grown = False  # see _warn_training_loaders_grown
        #: Whether the checkpoint a fit resumes has restored the loops, and whether a training loader was set up
        #: before that (see `load_optimizer_state_dict`); whether the fit loop said it restarts when the run began
        #: (a leftover of an earlier fit on the same Trainer: loops are restored later).
        self._restored = self._trained_loader_set_up_before_restore = self._restarting_left_over = False
        #: What `_prepare_first_epoch` set up each training loader for, by id (the fit loop keeps them alive).
        self._prepared_with: Dict[int, _Plan] = {}
        # The epoch _prepare_first_epoch gave a user's sampler in this fit, by id(sampler): (the sampler, epoch,
        # the wrapper that gave it). Dropped when the fit ends.
        self._epochs_given: Dict[int, Tuple[object, int, Wrapper]] = {}
        self._deals_current_epoch = False  # see _prepare_first_epoch
        # (epoch, batches trained) of an epoch a resumed fit leaves unfinished (see `_warn_of_unfinished_epoch`).
        self._unfinished_epoch: Optional[Tuple[int, int]] = None
        #: The number of ranks that wrote the checkpoint last loaded (None: not recorded, see `save_checkpoint`).
        self._checkpoint_world_size: Optional[int] = None
        self._warned_unsharded: set[tuple[Optional[RunningStage], str]] = set()
        #: The parameters of the module last given to `configure_ddp`, and which of them required grad then.
        self._wrapped_parameters: List[Parameter] = []
        self._wrapped_requires_grad: List[bool] = []

    # ------------------------------------------------------------------ process group
    @override
    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        joined_before = dist.is_available() and dist.is_initialized()
        self.init_ddp_connection(self.global_rank, self.world_size)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{type(self).__name__}.init_ddp_connection returned without a default process group: an override"
                " must call torch.distributed.init_process_group(...) (or super().init_ddp_connection(global_rank,"
                " world_size)) before it returns."
            )
        if not joined_before:  # also by an override of ours
            _exit.destroy_process_group_at_exit()
        _exit.release_at_exit(self)

    def _release_process_groups(self) -> None:
        """At exit: let go of the process groups this strategy holds, so that the exit handler frees them.

        The model wrapper holds its group (a rank that failed never tore it down), and optimizers and gradient
        scalers may hold one as an attribute (torch's ZeroRedundancyOptimizer and ShardedGradScaler as
        ``process_group``, fairscale's OSS as ``group``): such attributes are set to None, as nothing steps them
        after exit.
        """
        if self.lightning_module is not None:
            self.model = self.lightning_module
        scaler = getattr(self.precision_plugin, "scaler", None)
        for holder in (*self.optimizers, scaler):
            for name, value in list(getattr(holder, "__dict__", {}).items()):
                if isinstance(value, dist.ProcessGroup):
                    setattr(holder, name, None)

    def init_ddp_connection(self, global_rank: Optional[int] = None, world_size: Optional[int] = None) -> None:
        """Initialise the default process group; override to change how ranks meet.

        The backend is ``process_group_backend=`` when given, else NCCL for a CUDA root device and Gloo
        otherwise; ``timeout=`` bounds every collective, so a dead rank fails the others instead of hanging.
        ``global_rank`` and ``world_size`` default to this strategy's, as in Lightning 1.x's ``DDPPlugin``.
        """
        global_rank = self.global_rank if global_rank is None else global_rank
        world_size = self.world_size if world_size is None else world_size
        backend = self.select_process_group_backend()
        _compat.set_process_group_backend(self, backend)
        if dist.is_initialized():
            return
        assert self.cluster_environment is not None
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        kwargs: Dict[str, Any] = {"timeout": _compat.process_group_timeout(self)}
        if self.root_device.type == "cuda" and "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = self.root_device  # torch 2.3 on: binds the group to the GPU (eager NCCL set-up)
        log.info(f"Initializing distributed: GLOBAL_RANK: {global_rank}, MEMBER: {global_rank + 1}/{world_size}")
        dist.init_process_group(backend, rank=global_rank, world_size=world_size, **kwargs)
        joined = "1 process" if world_size == 1 else f"{world_size} processes"
        rank_zero_info(f"{type(self).__name__}: {joined} joined over {backend}.")

    def select_process_group_backend(self) -> str:
        """``process_group_backend=`` when given (known before the Trainer sets the devices), else NCCL for a CUDA
        root device and Gloo otherwise."""
        requested = _compat.requested_process_group_backend(self)
        return requested if requested is not None else process_group_backend_for(self.root_device)

    @property
    def data_parallel_group(self) -> Any:
        """The process group gradients are averaged over (the whole world)."""
        return dist.group.WORLD

    # ------------------------------------------------------------------ model wrapping
    @property
    def ddp_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for the model wrapper, as given to the constructor."""
        return _compat.ddp_kwargs(self)

    @override
    def setup_environment(self) -> None:
        # Before the LightningModule's `setup` hook, which may set the train loader up already (by reading
        # `trainer.estimated_stepping_batches`): Lightning's own sampler replacement must be off by then.
        self._restored = self._trained_loader_set_up_before_restore = False
        self._prepared_with = {}
        self._epochs_given = {}
        self._deals_current_epoch = False
        self._unfinished_epoch = None
        self._refuse_more_processes_than_devices()
        super().setup_environment()
        trainer = self._attached_trainer
        self._restarting_left_over = trainer is not None and trainer.fit_loop.restarting
        if trainer is not None:  # after the ranks are known, so that rank 0 alone says what it says
            self._take_over_sampler_replacement(trainer)
        self._broadcast_loader_seed()

    def _refuse_more_processes_than_devices(self) -> None:
        """Lightning checks only that ``num_nodes * devices`` is the world size a launcher reports: torchrun with
        2 processes on 1 node and ``Trainer(num_nodes=2, devices=1)`` passes, and local rank 1 then fails with an
        IndexError inside Lightning. Say what to change instead, before the process group is made."""
        devices = len(self.parallel_devices or ())
        if devices and not 0 <= self.local_rank < devices:
            raise RuntimeError(
                f"{type(self).__name__}: this process is local rank {self.local_rank} of its node, but Trainer(devices="
                f"{devices}) runs {devices} process(es) per node: the launcher started more processes per node than"
                " that. Make torchrun's --nproc_per_node (or srun's --ntasks-per-node) equal Trainer(devices=...),"
                " and --nnodes equal Trainer(num_nodes=...)."
            )

    def _broadcast_loader_seed(self) -> None:
        """seed=None takes seed_everything's seed, as Lightning's DistributedSampler does, but rank 0's: a seed
        that differs per rank (to vary augmentation) must not deal overlapping shares. Taken again in
        :meth:`setup`, after the LightningModule's ``setup`` hook, which may call ``seed_everything``."""
        self._global_seed = self.broadcast(int(os.getenv("PL_GLOBAL_SEED", 0)), src=0) if self.seed is None else None

    @override
    def setup(self, trainer: Trainer) -> None:
        self._take_over_sampler_replacement(trainer)
        if trainer.state.fn == TrainerFn.PREDICTING and self._replace_samplers:
            self._warn_of_sampler_kwargs_lightning_cannot_take()
        self._evaluating = False
        self._watched = {}
        self._verified_train_epoch = None
        self._warned_grown = False
        self._broadcast_loader_seed()
        with _compat.configure_ddp_called_without_arguments(self, self._wrap_lightning_model):
            super().setup(trainer)

    def _take_over_sampler_replacement(self, trainer: Trainer) -> None:
        """Turn Lightning's sampler replacement off for this run (``process_dataloader`` deals instead), unless
        the user turned it off. Predict loaders stay Lightning's: it shards them itself (without padding) and
        tracks their indices."""
        predicting = trainer.state.fn == TrainerFn.PREDICTING
        self._replace_samplers = _compat.take_over_sampler_replacement(trainer, take_over=not predicting)
        if not self._replace_samplers and not self._said_no_replacement:
            self._said_no_replacement = True
            rank_zero_info(
                f"{type(self).__name__}: Trainer(use_distributed_sampler=False) was given, so dataloaders are used as"
                " they are: each rank must load its own share."
            )

    @property
    def _attached_trainer(self) -> Optional[Trainer]:
        """The Trainer that runs this strategy's LightningModule, or None while none is attached (before a run,
        or in the main process after a spawn launch, where ``trainer.save_checkpoint`` still calls ``barrier``)."""
        module = self.lightning_module
        if module is None:
            return None
        try:
            return module.trainer
        except RuntimeError:  # Lightning's "is not attached to a `Trainer`"
            return None

    def _warn_of_sampler_kwargs_lightning_cannot_take(self) -> None:
        """Warn, before any predict loader is set up, when an overridden ``distributed_sampler_kwargs`` returns
        keys that Lightning's predict sharding would pass on to torch's samplers, which do not take them.

        A warning, not an error: Lightning shards only map-style loaders without a distributed sampler, so a
        predict run over an IterableDataset never passes them on. Where it does, its own TypeError ("got
        multiple values for argument 'shuffle'") follows, and this says why.
        """
        extra = sorted(set(self.distributed_sampler_kwargs) - set(_PREDICT_SAMPLER_KWARGS))
        if extra:
            rank_zero_warn(
                f"{type(self).__name__}.distributed_sampler_kwargs returned {extra} during predict. Lightning shards"
                " predict loaders itself and passes this dict to torch's DistributedSampler, which takes none of"
                " them (Lightning sets shuffle itself), so sharding a predict loader will raise a TypeError. Return"
                " them only when not predicting (check self.lightning_module.trainer.predicting), or predict with"
                " Trainer(use_distributed_sampler=False)."
            )

    def _wrap_lightning_model(self) -> None:
        assert self.model is not None
        # Through the class: during `setup` the instance attribute `configure_ddp` is this adapter.
        configure_ddp = type(self).configure_ddp
        model, device_ids = self.model, self.determine_ddp_device_ids()
        try:  # the signature of what is called: a decorator's wrapper, not the function it wraps
            inspect.signature(configure_ddp, follow_wrapped=False).bind(self, model, device_ids)
        except ValueError:  # a callable without a signature: nothing to check before calling it
            pass
        except TypeError:  # Lightning 2.x's own signature, configure_ddp(self), which wraps self.model in place
            raise TypeError(
                f"{type(self).__name__}.configure_ddp must take (self, model, device_ids), but its signature is"
                f" {inspect.signature(configure_ddp, follow_wrapped=False)}: {_CONFIGURE_DDP_CONTRACT}"
            ) from None
        # What DistributedDataParallel registers its gradient hooks for (see `on_train_batch_start`).
        self._wrapped_parameters = list(model.parameters())
        self._wrapped_requires_grad = list(map(_requires_grad, self._wrapped_parameters))
        wrapped = configure_ddp(self, model, device_ids)
        if not isinstance(wrapped, Module):
            raise TypeError(
                f"{type(self).__name__}.configure_ddp(model, device_ids) returned {type(wrapped).__name__}, not the"
                f" wrapped model: {_CONFIGURE_DDP_CONTRACT} Without the wrapper no gradient is synchronised."
            )
        if wrapped is model and self.world_size > 1:
            rank_zero_warn(
                f"{type(self).__name__}.configure_ddp(model, device_ids) returned the model itself: gradients are"
                " synchronised only if it does so itself (torch's composable replicate(), or hooks of your own)."
                f" Otherwise {_CONFIGURE_DDP_CONTRACT}"
            )
        self.model = wrapped
        self._register_comm_hook()
        _compat.restart_static_graph_delay(self)  # each new wrapper's first iteration, in every fit of the strategy

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Re-wrap the model when parameters were frozen or unfrozen since it was wrapped.

        torch's ``DistributedDataParallel`` hooks, when it is built, the parameters that require grad then:
        a parameter unfrozen later (Lightning's ``BaseFinetuning`` unfreezing a backbone) is never all-reduced,
        so each rank steps it on its own gradient and the ranks drift apart silently; a parameter frozen later
        leaves DDP waiting for its gradient (an error, or its bucket's gradients not reduced). Lightning calls
        this hook after the callbacks' and the LightningModule's batch-start hooks and before the step
        enters ``no_sync`` (gradient accumulation), so the new wrapper serves the whole step.

        The per-step cost is reading ``requires_grad`` of each parameter (no communication). Only a
        ``DistributedDataParallel`` (or subclass) returned by :meth:`configure_ddp` is re-wrapped; other
        wrappers are left to handle such changes themselves.
        """
        super().on_train_batch_start(batch, batch_idx)
        if isinstance(self.model, DistributedDataParallel):
            now = list(map(_requires_grad, self._wrapped_parameters))
            if now != self._wrapped_requires_grad:
                self._rewrap_for_changed_requires_grad(now)

    def _rewrap_for_changed_requires_grad(self, now: List[bool]) -> None:
        """Wrap the module again through :meth:`configure_ddp` (the user's override), after retiring the old wrapper.

        Every rank must get here at the same batch: the DDP constructor is a collective (it checks the
        parameters' shapes across ranks and broadcasts rank 0's parameters and buffers). Flags changed in
        callbacks or LightningModule hooks change on every rank alike. Ranks that all changed them, but
        differently, raise a RuntimeError here on every rank, naming the first parameter that differs (one
        all-gather of a digest; the flags themselves are gathered only then). Flags changed on some ranks only
        cannot be detected without a collective at every step: the re-wrapping ranks' collectives then meet the
        others' gradient all-reduce, which fails or runs into the process group's ``timeout``.

        Gradients held when it happens (local sums of a ``no_sync`` window, or the last step's, already
        averaged) are averaged here (``_gradients.average_held_gradients``): the new wrapper does not reduce
        those of newly frozen parameters, and with ``find_unused_parameters=True`` it would take a parameter
        used only before the re-wrap for unused by every rank and leave each rank its local sum (stock DDP
        remembers which parameters a ``no_sync`` window used; a new wrapper starts without that record).
        Averaged, the new wrapper's sum at the window's end averages to the same as on one process.

        DDP's experimental ``mixed_precision`` argument is refused: the forward hooks it adds to every submodule
        cannot be removed from the old wrapper.

        Parameters are equal on all ranks here; buffers need not be (BatchNorm's running statistics follow each
        rank's batches). The new wrapper broadcasts rank 0's parameters and, unless ``broadcast_buffers=False``,
        rank 0's buffers, as DDP's constructor does (with the default ``broadcast_buffers=True`` every forward
        does so anyway). It starts a new static graph (``static_graph=True``) and gets the comm hook again
        (``ddp_comm_hook``, or whatever ``configure_ddp`` registers); PowerSGD's per-bucket error feedback and
        low-rank memories are cleared first (``_gradients.restart_per_bucket_state``), as the buckets change.
        """
        old = self.model
        assert isinstance(old, DistributedDataParallel)
        if getattr(old, "mixed_precision", None) is not None:
            raise RuntimeError(
                f"{type(self).__name__}: parameters were frozen or unfrozen after the model was wrapped with"
                " DistributedDataParallel's experimental mixed_precision argument, whose forward hooks cannot be"
                " removed to wrap it again. Drop mixed_precision (Lightning's precision='bf16-mixed' or"
                " '16-mixed' does the same job), or change requires_grad before the fit starts."
            )
        before = self._wrapped_requires_grad
        self._agree_on_requires_grad(now)
        # While the old wrapper still works: should a collective here fail, the model is still wrapped. Not the
        # parameters DDP was told to ignore (they may even differ between ranks).
        ignored = set(getattr(old.module, "_ddp_params_and_buffers_to_ignore", ()))
        skipped = {id(p) for name, p in old.module.named_parameters() if name in ignored}
        average_held_gradients(
            [p for p, was in zip(self._wrapped_parameters, before) if was and id(p) not in skipped],
            self.data_parallel_group,
            self.root_device,
        )
        cuda = self.root_device.type == "cuda"
        if cuda:  # the old wrapper's reduction, the optimizer step and the average are done before the new wrapper
            torch.cuda.synchronize(self.root_device)  # reads them on a side stream (and rank 0's parameters go out)
        # Its hooks stay on the parameters' gradient accumulators until the reducer is freed (a reference
        # cycle may keep it alive); a hook left behind would reduce into the old buckets.
        getattr(old, "_remove_autograd_hooks", lambda: None)()
        for handle in getattr(old, "_accum_grad_hooks", ()):
            handle.remove()
        for state in _compat.comm_hook_states(old, self):
            restart_per_bucket_state(state)
        module = old.module
        self.model = module
        retired = weakref.ref(old)
        del old
        if retired() is not None:  # kept alive by a reference cycle: free its buckets (a wrapper's worth of
            gc.collect()  # gradient memory) now, before the new ones are allocated, not at some later step
        self._wrap_lightning_model()
        if self.model is module:
            raise RuntimeError(
                f"{type(self).__name__}: parameters were frozen or unfrozen after the model was wrapped in"
                " DistributedDataParallel, and wrapping it again left it unwrapped. Change requires_grad before"
                " the fit starts, or make configure_ddp return a new wrapper."
            )
        if cuda:
            torch.cuda.synchronize(self.root_device)
        unfrozen = sum(n and not b for n, b in zip(now, before))
        frozen = sum(b and not n for n, b in zip(now, before))
        rank_zero_info(
            f"{type(self).__name__}: {unfrozen} parameter tensor(s) unfrozen and {frozen} frozen since the model was"
            f" wrapped; wrapped it again ({sum(now)} now require grad) so that DistributedDataParallel synchronises"
            " the right gradients."
        )

    def _agree_on_requires_grad(self, flags: List[bool]) -> None:
        """Raise on every rank, naming the first parameter that differs, when the ranks about to re-wrap froze or
        unfroze different parameters."""
        group = self.data_parallel_group
        mine = torch.tensor([sum(flags), zlib.crc32(bytes(flags))], dtype=torch.int64, device=self.root_device)
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        if all(torch.equal(other, gathered[0]) for other in gathered):
            return
        every: List[Any] = [None] * len(gathered)
        dist.all_gather_object(every, flags, group=group)
        counts = {rank: sum(ranks_flags) for rank, ranks_flags in enumerate(every)}
        # None (for a StopIteration would end Lightning's epoch loop silently) only if the digests differ but
        # the flags do not, or ranks wrapped different numbers of parameters
        index = next((i for i, column in enumerate(zip(*every)) if len(set(column)) > 1), None)
        first = ""
        if index is not None:
            parameter = self._wrapped_parameters[index]
            module = self.lightning_module
            names = {id(p): name for name, p in module.named_parameters()} if module is not None else {}
            does = [rank for rank, ranks_flags in enumerate(every) if ranks_flags[index]]
            does_not = [rank for rank, ranks_flags in enumerate(every) if not ranks_flags[index]]
            first = (
                f" {names.get(id(parameter), f'parameter #{index}')} requires grad on rank(s) {does} but not on"
                f" rank(s) {does_not} (the first that differs);"
            )
        raise RuntimeError(
            f"{type(self).__name__}: the parameters that require grad differ between ranks:{first} tensors that"
            f" require grad, per rank: {counts}. Every rank must freeze and unfreeze the same parameters at the same"
            " step: change requires_grad in code that runs alike on every rank (a callback, a LightningModule hook),"
            " not depending on the rank or on per-rank randomness."
        )

    def configure_ddp(self, model: Module, device_ids: Optional[List[int]]) -> Module:  # type: ignore[override]
        """Wrap ``model`` for data-parallel training and return the wrapper; override to use another wrapper.

        The default is ``DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)`` with
        ``find_unused_parameters=False`` unless given. A wrapper with a ``no_sync()`` context manager gets
        its gradient synchronisation skipped during gradient accumulation.
        """
        kwargs = {"find_unused_parameters": False, **self.ddp_kwargs}
        # Build DDP on a side stream on GPU, as Lightning does (https://pytorch.org/docs/stable/notes/cuda.html).
        stream = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with stream:
            return DistributedDataParallel(module=model, device_ids=device_ids, **kwargs)

    def _register_comm_hook(self) -> None:
        """Register ``ddp_comm_hook`` on any device (Lightning only does so on CUDA; gloo supports hooks too)."""
        state, hook, hook_wrapper = _compat.comm_hook_arguments(self)
        if hook is None:
            return
        register = getattr(self.model, "register_comm_hook", None)
        if not callable(register):
            raise TypeError(
                f"ddp_comm_hook was given but the model wrapper {type(self.model).__name__} returned by configure_ddp"
                " has no register_comm_hook(); return a DistributedDataParallel or drop ddp_comm_hook."
            )
        register(state=state, hook=hook_wrapper(hook) if hook_wrapper is not None else hook)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip gradient synchronisation (``no_sync()``) of whatever wrapper ``configure_ddp`` returned."""
        no_sync = getattr(self.model, "no_sync", None)
        with no_sync() if callable(no_sync) else nullcontext():
            yield None

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Refuse, on this rank, a loss that depends on no parameter while gradients are synchronised.

        Such a loss (``torch.zeros((), requires_grad=True)`` for a batch with nothing to learn from, common in
        metric learning) backpropagates to nothing, so this rank would run none of the wrapper's gradient
        all-reduces: the other ranks would wait in theirs until the timeout, or pair them with this rank's next
        step's, silently. Raised here, the launcher ends every rank with this message.
        """
        if closure_loss.requires_grad and self._synchronises_gradients() and not reaches_a_parameter(closure_loss):
            raise RuntimeError(
                f"{type(self).__name__}: the loss of this backward pass on rank {self.global_rank} depends on no"
                " parameter (like torch.zeros((), requires_grad=True) returned for a batch with nothing to learn"
                " from). The wrapper all-reduces gradients during backward, so this rank would take part in none"
                " of those all-reduces and the other ranks would wait for it. Return a loss computed from the"
                " model's output that is zero when there is nothing to learn, e.g. embeddings.sum() * 0."
            )
        super().pre_backward(closure_loss)

    def _synchronises_gradients(self) -> bool:
        """Whether the model wrapper all-reduces gradients in this backward pass (not inside ``no_sync``)."""
        return self.world_size > 1 and bool(getattr(self.model, "require_backward_grad_sync", False))

    def get_model_from_plugin(self, model: Module) -> LightningModule:
        """Unwrap ``model`` (a wrapper returned by :meth:`configure_ddp`) down to the LightningModule."""
        while not isinstance(model, LightningModule) and isinstance(getattr(model, "module", None), Module):
            model = getattr(model, "module")
        if not isinstance(model, LightningModule):
            raise TypeError(f"{type(model).__name__} does not wrap a LightningModule through `.module`.")
        return model

    @override
    def teardown(self) -> None:
        if self.model is not None and self.lightning_module is not None and not isinstance(
            self.model, DistributedDataParallel
        ):
            self.model = self.lightning_module  # unwrap custom wrappers too, not only torch's DDP
        self._wrapped_parameters, self._wrapped_requires_grad = [], []
        self._epochs_given = {}  # holds user samplers
        self._drop_pending_skips()
        super().teardown()

    def _drop_pending_skips(self) -> None:
        """Drop the resume skips this strategy set that no training iteration took (a resumed fit with no step
        left, or one that failed first): a later iteration of a loader its user keeps must read it whole."""
        for wrapper, owner in list(_PENDING_SKIPS.items()):
            if owner == id(self):
                _drop_skip(wrapper)

    # ------------------------------------------------------------------ data
    @property
    def sampler_options(self) -> Dict[str, Any]:
        """The constructor's options for the sampler wrappers of training loaders (see :meth:`sharding_options`)."""
        return {
            "shuffle": self.shuffle_batches_between_ranks,
            "shuffle_window": self.shuffle_window,
            "seed": self.seed if self.seed is not None else self._loader_seed(),
            "pad": self.pad_to_world_size,
            "even_shares": True,
        }

    def _loader_seed(self) -> int:
        """seed_everything's seed on rank 0 when the trainer was set up (this process's, before that)."""
        return self._global_seed if self._global_seed is not None else int(os.getenv("PL_GLOBAL_SEED", 0))

    @property
    @override
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        """``num_replicas`` and ``rank`` of this process; override to add sharding options.

        An override may add ``shuffle``, ``shuffle_window``, ``seed``, ``pad`` or ``drop_last`` (read as
        ``pad=not drop_last``); they win over the constructor's options. Validation and test loaders keep what
        ``eval_mode`` needs whatever is returned here: no shuffle, and padded ("pad") or exact ("exact")
        shares. Lightning's predict loaders get this dict as torch's ``DistributedSampler`` arguments, so while
        predicting return only ``drop_last`` and ``seed`` besides the ranks (other keys get a warning then, and
        torch's sampler rejects them). See :meth:`sharding_options`.
        """
        return dict(super().distributed_sampler_kwargs)

    def sharding_options(self, training: bool) -> Dict[str, Any]:
        """The keyword arguments given to ``patch_dataloader_to_ddp`` for a training or evaluation loader.

        Precedence, lowest first: the constructor's options (:attr:`sampler_options`), then the keys of
        :attr:`distributed_sampler_kwargs`, then, for validation and test, ``shuffle=False``, ``pad=True``
        and the share kind of ``eval_mode``: evaluation never drops samples, even with
        ``pad_to_world_size=False``, which only concerns training. ``shuffle`` and ``shuffle_window`` apply to
        custom samplers: a loader with a default sampler becomes a ``DistributedSampler`` that shuffles as the
        loader did (``DataLoader(shuffle=...)``), whatever they say.
        """
        hook = dict(self.distributed_sampler_kwargs)
        unknown = sorted(set(hook) - set(_SAMPLER_KWARGS))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.distributed_sampler_kwargs returned {unknown}, which this strategy does not"
                f" use; the keys it accepts are {list(_SAMPLER_KWARGS)} (how evaluation loaders are dealt is"
                " eval_mode's choice). Drop the others."
            )
        if "drop_last" in hook:
            pad = not hook.pop("drop_last")
            if hook.setdefault("pad", pad) != pad:
                raise ValueError(
                    f"{type(self).__name__}.distributed_sampler_kwargs returned pad={hook['pad']} and"
                    f" drop_last={not pad}, which disagree (pad means not drop_last); return one of them."
                )
        options = {**self.sampler_options, **hook}
        if not training:
            options.update(shuffle=False, pad=True, even_shares=self.eval_mode == "pad")
        return options

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Give each rank its share of ``dataloader``.

        Why here: ``process_dataloader`` is the one strategy hook Lightning calls for every train, val and test
        loader, after its own sampler replacement (turned off by :meth:`setup_environment`) and before the
        loader is iterated or its length is read; the loop's ``set_epoch`` calls reach our wrapper through
        ``loader.batch_sampler.sampler``, so epochs come from Lightning's loop, resumes included.
        """
        trainer = self._attached_trainer
        if trainer is not None and trainer.state.stage == RunningStage.TRAINING and not self._loops_restored(trainer):
            self._trained_loader_set_up_before_restore = True  # see load_optimizer_state_dict
        if trainer is None:
            return dataloader
        stage = trainer.state.stage
        if stage == RunningStage.PREDICTING:
            return dataloader  # Lightning shards predict loaders itself (see `setup`)
        training = stage == RunningStage.TRAINING
        if not self._replace_samplers:  # used as they are; one its user dealt with our wrapper still records
            record_yielded_in_evaluation(wrapper_of(dataloader), training)
            return dataloader
        try:
            overfitting = training and getattr(trainer, "overfit_batches", 0) > 0  # set by Lightning's debugging flags
            patched = self._patch(dataloader, training, overfitting)
            if patched is not None:
                source, length = dealt_source(patched)
            else:
                source, length = NOT_DEALT_SOURCE, NOT_DEALT  # whatever its class: it only says "not dealt"
        except Exception as error:
            if self.check_sampler_consistency:  # the other ranks are about to wait for this one in the length check
                report_failure(error)
            raise
        if self.check_sampler_consistency:
            # Every rank must deal the same number of items, or the ranks step different numbers of times. Every
            # loader takes part, dealt or not, so that no rank is left waiting for one that deals no loader here.
            verify_same_sequence(SequenceDigest(source, -1, length, 0, 0))
        if not isinstance(dataloader, DataLoader) and not is_empty(dataloader):  # nothing to shard in []
            self._warn_unsharded(dataloader, stage)
        # Not dealt here (patched is None): its user's, possibly with our wrapper, or not a DataLoader. Prepared
        # and checked as if we had dealt it.
        loader = patched if patched is not None else dataloader
        wrapper = wrapper_of(loader)
        record_yielded_in_evaluation(wrapper, training)
        if patched is dataloader or not isinstance(loader, DataLoader):  # an empty split, or not a DataLoader
            return loader
        if wrapper is not None and not training and not wrapper.even_shares:
            setting, limit = _evaluation_limit(trainer, stage)
            self._refuse_rank_without_batches(loader, wrapper, stage, setting, limit, user_dealt=patched is None)
        if training:
            self._prepare_first_epoch(loader, trainer)
        return loader

    def _patch(self, dataloader: object, training: bool, overfitting: bool = False) -> Optional[DataLoader]:
        """``dataloader`` dealt for this rank (``dataloader`` itself when it is an empty split); None for a loader
        that is not dealt: not a DataLoader, an IterableDataset, or a loader its user sharded."""
        if not isinstance(dataloader, DataLoader):
            return None
        options = self.sharding_options(training)
        default = uses_default_sampler(dataloader)
        # overfit_batches trains the same batches every epoch: Lightning turns a loader's own shuffling off (and
        # warns), so the batch shuffle of a custom sampler goes off too, or each epoch would overfit other batches.
        unshuffled_for_overfitting = overfitting and not default and bool(options.get("shuffle"))
        if unshuffled_for_overfitting:
            options["shuffle"] = False
        # An empty split under a plain loader has nothing to deal: 0 batches, and Lightning's warning, as with
        # "ddp". It still takes part in the length check, which fails on every rank if others are not empty.
        empty = default and len(dataloader.dataset) == 0  # type: ignore[arg-type]
        if default:
            # A DistributedSampler, shuffled when the loader was (stock Lightning shuffles every training loader;
            # we keep the user's choice): the batch shuffle and its window are for custom samplers.
            options.update(shuffle=None, shuffle_window=None)
        if empty:
            return dataloader
        world, rank = options.pop("num_replicas", None), options.pop("rank", None)
        patched = _patch_dataloader(dataloader, world, rank, options, keep_class=False, owner=type(self).__name__)
        if patched is dataloader:
            return None
        wrapper = wrapper_of(patched)
        if overfitting and isinstance(wrapper, DistributedBatchSamplerWrapper):
            # the batches a single process overfits: its loop never calls the batch sampler's own set_epoch
            wrapper.forward_epoch_to_batch_sampler = False
        if unshuffled_for_overfitting:
            rank_zero_warn(
                f"{type(self).__name__}: overfit_batches is set, so this training loader's batches are dealt without"
                " shuffle_batches_between_ranks (every epoch trains on the same batches, as Lightning turns a"
                " loader's own shuffling off).",
                category=UserWarning,
            )
        if type(dataloader) is not DataLoader:  # a subclass: keep its class (its __iter__, its arguments)
            patched = _compat.rebuild_dataloader(dataloader, patched)
        return patched

    def _refuse_rank_without_batches(
        self,
        loader: DataLoader,
        wrapper: Wrapper,
        stage: Optional[RunningStage],
        setting: str = "limit_val_batches",
        limit: Union[int, float] = 1.0,
        user_dealt: bool = False,
    ) -> None:
        """Raise, on every rank alike, when an exact deal (ours, or a ``user_dealt`` wrapper with
        ``even_shares=False``) leaves some rank with no evaluation batch, or with none of the fraction ``limit``
        (the value of the stage's ``setting``, its ``limit_*_batches``) takes.

        Lightning skips the whole evaluation on such a rank, epoch-end hooks included, so the other ranks'
        epoch-end collectives (``sync_dist=True``, torchmetrics, ``gather_in_order``, the consistency check) would
        pair with unrelated ones: a hang or a wrong result. A fraction that leaves it none makes Lightning raise
        there alone, while the others go on.
        """
        fewest = fewest_exact_batches(loader, wrapper)
        who, fix = (f"{type(wrapper).__name__}(even_shares=False)", "even_shares=True") if user_dealt else (
            f"{type(self).__name__}(eval_mode='exact')", "eval_mode='pad'"
        )
        world, dealt = wrapper.num_replicas, len(wrapper.source)  # type: ignore[arg-type]
        name = stage.value if stage else "evaluation"
        if fewest > 0 and isinstance(limit, float) and 0 < limit < 1 and int(fewest * limit) == 0:
            raise RuntimeError(
                f"{who}: {setting}={limit} of the {name} loader's batches leaves rank {world - 1}, which is dealt"
                f" {fewest}, none ({fewest} * {limit} < 1): Lightning raises on a rank left none, not on every rank."
                f" Pass {setting} as a number of batches (an int), a larger fraction, or use {fix}."
            )
        if fewest > 0:
            return
        items = "batches" if isinstance(wrapper, DistributedBatchSamplerWrapper) else "samples"
        raise RuntimeError(
            f"{who}: the {name} loader deals"
            f" {dealt} {items} of {type(wrapper.source).__name__} among {world} ranks, which leaves rank {world - 1}"
            " without a batch; Lightning would skip evaluation there and the other ranks' epoch-end synchronisation"
            f" would hang or give wrong values. Use fewer ranks, a smaller batch size, or {fix}."
        )

    def _prepare_first_epoch(self, loader: DataLoader, trainer: Trainer) -> None:
        """Set the epoch now, and the resume position after a mid-epoch checkpoint.

        Lightning creates the training iterator before its loop calls ``set_epoch``: with ``num_workers > 0``
        that iterator draws its first indices at once, so a resumed fit would train its first epoch on the
        sequence of epoch 0. After a mid-epoch checkpoint, Lightning runs only the batches left in the epoch
        but restarts a plain DataLoader at the epoch's start; the wrapper skips the batches already trained
        instead, so the resumed run sees exactly the batches an uninterrupted one would. A stateful loader
        (``StatefulDataLoader``) restores its own position, so its wrapper skips nothing. A loader shorter than
        the epoch (one of several in a ``CombinedLoader``) that ran out before the checkpoint either starts its
        pass again ("max_size_cycle") or yields nothing more ("max_size"), as it did in the interrupted run.
        """
        sampler, wrapper = epoch_sampler(loader), wrapper_of(loader)
        epoch, dealt, resume = plan = self._first_epoch_plan(loader, trainer)
        trains = _compat.fit_trains_an_epoch(trainer)
        self._unfinished_epoch = _compat.epoch_left_unfinished(trainer) if trains else None
        self._prepared_with[id(loader)] = plan
        # A fit resumed inside an epoch that max_steps ended: its loop passes set_epoch one more than the epoch it
        # runs, to the end of the fit (see _compat._restarted_epoch); its training loaders deal the epoch it runs.
        self._deals_current_epoch = self._deals_current_epoch or (dealt is not None and dealt != epoch)
        if wrapper is not None and self._deals_current_epoch:
            wrapper._loop_epoch_to_deal = _compat.TrainingEpochToDeal(trainer)
        # A fit with nothing left to train (resumed at max_epochs) starts no epoch, so its loop sets none either.
        if sampler is not None and epoch is not None and trains:
            if isinstance(sampler, WRAPPER_TYPES):
                # The user's object may be at another epoch than a new wrapper: an earlier wrapper moved it on (a
                # tuner's run of more than an epoch before the fit), and an iterator made before the loop's
                # set_epoch (workers draw at once) would deal that epoch's order.
                last = _epoch_forwarded_to(sampler.source)
                moved_on = last is not None and last != dealt
                if sampler.epoch != dealt or dealt != epoch or moved_on:  # else the loop's set_epoch is enough
                    # Not forwarded twice by two set-ups of the fit's first epoch (with
                    # reload_dataloaders_every_n_epochs, the fit loop sets its loaders up again as a resumed epoch
                    # starts), each wrapping the user's object. Unless the loop has called set_epoch since (on the
                    # wrapper that gave it), which may have given the user's object another epoch in between.
                    given = self._epochs_given.get(id(sampler.source))
                    forwarded = (
                        not moved_on and given is not None and given[0] is sampler.source and given[1] == dealt
                        and given[2]._epoch_set_ahead is not None
                    )
                    sampler._set_epoch_ahead_of_loop(epoch, dealt_as=dealt, forwarded=forwarded)
                    given_epoch = epoch if dealt is None else dealt
                    self._epochs_given[id(sampler.source)] = (sampler.source, given_epoch, sampler)
            elif sampler.epoch != epoch:
                sampler.set_epoch(epoch)
        if wrapper is None:
            return
        if resume is None:
            _drop_skip(wrapper)  # a loader its user keeps may hold an earlier fit's skip
            return
        # Decided when the resumed iteration reads its first item: a loader shorter than the epoch ran out before
        # the checkpoint, and what it did then depends on the CombinedLoader's mode, which Lightning knows only
        # once every loader is processed.
        self._arm_skip(trainer, loader, wrapper, *resume)

    def _first_epoch_plan(self, loader: DataLoader, trainer: Trainer) -> _Plan:
        """What :meth:`_prepare_first_epoch` sets for ``loader`` now (see ``_Plan``)."""
        epoch = _compat.epoch_for_samplers(trainer) if epoch_sampler(loader) is not None else None
        wrapper = wrapper_of(loader)
        if wrapper is None:
            return epoch, epoch, None
        resume = _compat.mid_epoch_resume(trainer)
        if resume is not None:
            dealt: Optional[int] = resume[0]  # the epoch whose batches were trained
        elif epoch is not None and self._deals_current_epoch:  # a later set-up (reload_dataloaders_every_n_epochs)
            dealt = _compat.TrainingEpochToDeal(trainer)(epoch)
        else:
            dealt = epoch
        if resume is None or not 0 < resume[1] or _compat.restores_loader_position(trainer, loader):
            return epoch, dealt, None
        return epoch, dealt, resume

    def _arm_skip(self, trainer: Trainer, loader: DataLoader, wrapper: Wrapper, epoch: int, done: int) -> None:
        """Make ``wrapper``'s next iteration of ``epoch`` ask :meth:`_resume_skip` what to skip."""
        wrapper.resume_within_epoch(epoch, partial(self._resume_skip, trainer, loader, wrapper, epoch, done))
        _PENDING_SKIPS[wrapper] = id(self)

    def _resume_skip(self, trainer: Trainer, loader: DataLoader, wrapper: Wrapper, epoch: int, done: int) -> int:
        """Items the first iteration read during training, of a fit resumed ``done`` batches into ``epoch``, skips;
        said on rank 0. A loader its user dealt may serve validation too, which reads first after a checkpoint
        written during validation: that iteration skips nothing, and the skip waits for one read in training.
        ``done`` counts each rank's batches on the ranks that wrote the checkpoint (see :meth:`_done_on_this_world`)."""
        if trainer.state.stage != RunningStage.TRAINING:
            self._arm_skip(trainer, loader, wrapper, epoch, done)
            return 0
        _PENDING_SKIPS.pop(wrapper, None)  # taken
        name, source, batches = type(self).__name__, type(wrapper.source).__name__, len(loader)
        old_world, moved = self._checkpoint_world_size, False
        if old_world is not None and old_world != self.world_size:
            done, moved = self._done_on_this_world(wrapper, epoch, done, old_world), True
        if done < batches:
            if not moved:  # else the warning said what the skip misses
                rank_zero_info(
                    f"{name}: resuming mid-epoch, {source} skips the {done} batch(es) of epoch {epoch} trained"
                    " before the checkpoint (so Lightning's warning that the dataloader is not resumable does not"
                    " apply to it, if it yields the sequence it yielded before: its own state is not checkpointed)."
                )
            return items_in(done, loader, wrapper)
        mode = _compat.training_loader_mode(trainer)
        said = (
            f"{name}: resuming mid-epoch {done} batches in, past the end of {source} ({batches} batches per epoch on"
            f" each rank): in CombinedLoader's mode {repr(mode) if mode else repr('max_size_cycle') + ' (assumed)'}"
        )
        if mode == "max_size":
            rank_zero_info(f"{said} it ran out before the checkpoint, so it yields nothing more this epoch.")
            return len(wrapper)
        # "max_size_cycle" (Lightning's default) restarts a loader each time it runs out.
        done %= max(1, batches)
        rank_zero_info(f"{said} it restarted when it ran out, so it skips the {done} batch(es) of its current pass.")
        return items_in(done, loader, wrapper)

    def _done_on_this_world(self, wrapper: Wrapper, epoch: int, done: int, old_world: int) -> int:
        """The batches of ``epoch`` each rank skips after a checkpoint that ``old_world`` ranks wrote ``done`` batches
        into it; a warning says what that costs. Those ranks trained the first ``done * old_world`` positions of the
        dealt sequence: the shares start again after them, rounded down to a whole round of this run's ranks."""
        world, trained = self.world_size, done * old_world
        skip = trained // world
        untrained = done - skip  # per rank: Lightning runs the epoch's steps left after `done`
        said = (
            f"{type(self).__name__}: resuming mid-epoch from a checkpoint that {old_world} rank(s) wrote, on {world}:"
            f" they trained the first {trained} batch(es) of epoch {epoch} ({done} each), so each rank skips its"
            f" first {skip} batch(es) of the epoch, and {trained - skip * world} batch(es) are trained twice."
            f" Lightning goes on counting the epoch's steps from the checkpoint's {done}, so"
        )
        said += (
            f" each rank's last {untrained} batch(es) of epoch {epoch} ({untrained * world} in all) are not trained."
            if untrained > 0
            else " the epoch ends early, when the loader runs out, and no batch of it is left untrained."
        )
        if wrapper.shuffle:
            said += (
                " The batches are shuffled, and the order they are dealt in depends on the number of ranks (windows"
                " of shuffle_window * W batches, padding to a multiple of W): the skip is approximate, some batches"
                " of this epoch are trained twice and others not at all."
            )
        rank_zero_warn(said)
        return skip

    def _warn_unsharded(self, dataloader: object, stage: Optional[RunningStage]) -> None:
        kind = type(dataloader).__name__
        if (stage, kind) in self._warned_unsharded:
            return
        self._warned_unsharded.add((stage, kind))
        rank_zero_warn(
            f"{type(self).__name__}: the {stage.value if stage else ''} loader {kind} is not a torch DataLoader, so it"
            " cannot be sharded: every rank iterates all of it. Wrap the data in a torch.utils.data.DataLoader, or"
            " shard it yourself (read torch.distributed.get_rank() in its __iter__)."
        )

    def _verify(self, stage: RunningStage) -> None:
        """One collective comparing the digests (head and last whole epoch) of the wrappers of the loaders
        ``stage`` runs now.

        The same list on every rank: the trainer's current loaders, in loader order. Wrappers of loaders
        that a reload replaced since the last check contribute their last epoch's digest once more, then are
        dropped, so reloading every epoch neither piles wrappers up nor leaves an epoch unchecked.
        """
        trainer = self._attached_trainer
        if trainer is None or not self._replace_samplers:
            return
        key = "train" if stage == RunningStage.TRAINING else "eval"
        current = [w for w in map(wrapper_of, _compat.current_loaders(trainer, stage)) if w is not None]
        replaced = [w for w in self._watched.get(key, []) if not any(w is c for c in current)]
        self._watched[key] = current
        digests: List[Optional[SequenceDigest]] = []
        digests.extend(digest for wrapper in current for digest in (wrapper.head_digest, whole_epoch_digest(wrapper)))
        digests.extend(map(whole_epoch_digest, replaced))
        if digests:
            verify_same_sequence(*digests)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # Once per epoch, at its first step and so before its first optimizer step: the sequence every rank
        # read so far (the head of this epoch, the whole previous epoch) must agree.
        trainer = self._attached_trainer
        if trainer is not None and trainer.current_epoch != self._verified_train_epoch:
            self._verified_train_epoch = trainer.current_epoch
            self._warn_training_loaders_grown(trainer)
            if self.check_sampler_consistency:
                self._verify(RunningStage.TRAINING)
        return super().training_step(*args, **kwargs)

    def _warn_training_loaders_grown(self, trainer: Trainer) -> None:
        """Warn when the dealt training loaders hold more batches this epoch than Lightning takes: it counts an
        epoch's batches when it sets the loaders up (until it sets them up again), so the rest of a loader that
        grew after that would not be trained, silently. A sampler whose length follows ``set_epoch`` (a
        curriculum) does it without ``reload_dataloaders_every_n_epochs=1``; a change made in
        ``on_train_epoch_start`` with it too (Lightning read the length before)."""
        if self._warned_grown or getattr(trainer, "overfit_batches", 0) > 0:  # once a fit: each epoch would say it
            return
        read, loaders = _compat.training_batches_read(trainer), _compat.current_loaders(trainer, RunningStage.TRAINING)
        dataloaders = [loader for loader in loaders if isinstance(loader, DataLoader)]
        if read is None or len(read) != len(loaders) or len(dataloaders) != len(loaders):
            return  # another kind of loader may have no length, and has no wrapper of ours
        lengths = [_sized_len_or_inf(loader) for loader in dataloaders]  # a DataLoader of a stream has none
        counted = _compat.training_batches_per_loader(trainer, lengths)  # under limit_train_batches, as ``read``
        if not counted or _compat.training_epoch_batches(trainer, counted) <= trainer.num_training_batches:
            return
        grown = next(
            (
                (wrapper, int(length)) for loader, length, now, before in zip(dataloaders, lengths, counted, read)
                if (wrapper := wrapper_of(loader)) is not None and now > before
            ),
            None,
        )
        if grown is None:
            return
        self._warned_grown = True
        wrapper, length = grown
        reloads_every_epoch = getattr(trainer, "reload_dataloaders_every_n_epochs", 0) == 1
        how = (
            "Lightning read its length before (in on_train_epoch_start, say): change it in your sampler's set_epoch,"
            " or in on_train_epoch_end for the next epoch." if reloads_every_epoch else
            "A sampler whose length changes with the epoch needs Trainer(reload_dataloaders_every_n_epochs=1), so"
            " that Lightning reads it again for every epoch."
        )
        rank_zero_warn(
            f"{type(self).__name__}: the training loader over your {wrapper._source_name} has {length} batches per"
            f" rank in epoch {trainer.current_epoch}, but Lightning counted the epoch's batches when it set the"
            f" loaders up and takes {int(trainer.num_training_batches)}: the rest of this epoch is not trained. {how}"
        )

    @override
    def save_checkpoint(
        self, checkpoint: Dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Save ``checkpoint`` with the number of ranks, which a fit resumed mid-epoch on another number needs."""
        recorded = {**checkpoint, "lightning_ddp_ext": {"world_size": self.world_size}}
        super().save_checkpoint(recorded, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """Load the checkpoint and remember how many ranks wrote it (None when it does not say)."""
        checkpoint: Dict[str, Any] = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._checkpoint_world_size = (checkpoint.get("lightning_ddp_ext") or {}).get("world_size")
        return checkpoint

    def _loops_restored(self, trainer: Trainer) -> bool:
        """Whether a checkpoint has restored the fit loop in this run: :meth:`load_optimizer_state_dict` ran, or
        the loop restarts (also under a strategy that restores its own optimizers), not as a leftover of an
        earlier fit on the same Trainer."""
        return self._restored or (trainer.fit_loop.restarting and not self._restarting_left_over)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        # Lightning restores the loops just before the optimizers: the first moment a training loader set up
        # before that can learn where the checkpoint was written. (A tuner restoring its temporary checkpoint
        # comes here too, and prepares the loaders for the start it restores.)
        self._restored = True
        trainer = self._attached_trainer
        if self._trained_loader_set_up_before_restore and trainer is not None:
            self._prepare_training_loaders_again(trainer)

    def _prepare_training_loaders_again(self, trainer: Trainer) -> None:
        """Prepare the training loaders for the restored epoch and position, and make their iterator again.

        Reading ``trainer.estimated_stepping_batches`` has Lightning set the training loaders up, and make the
        iterator the resumed epoch runs on, before it restores the checkpoint's loops: in a LightningModule
        ``setup`` or ``configure_model`` hook even before it loads the checkpoint, so that iterator would train the
        batches before a mid-epoch checkpoint again and draw them in epoch 0's order with ``num_workers > 0`` (its
        workers read the sampler at once); in ``configure_optimizers`` or an ``on_fit_start`` hook the position is
        read from the loaded checkpoint, but stateful loaders would be left unrestored. Nothing to do when the fit
        loop is about to set its loaders up again, or when the iterator made then yields what a new one would.
        """
        if _compat.reloads_training_loaders(trainer):
            return
        loaders = _compat.current_loaders(trainer, RunningStage.TRAINING)
        prepared = [loader for loader in loaders if isinstance(loader, DataLoader)] if self._replace_samplers else []
        stale = any(
            self._first_epoch_plan(loader, trainer) != self._prepared_with.get(id(loader), _NOTHING_PLANNED)
            for loader in prepared
        )
        if not stale and not _compat.pending_loader_states(trainer):
            return
        # The iterator has started: a loader changed under it (a new epoch, a skip) but left to it would be wrong.
        one_shot = [type(loader).__name__ for loader in loaders if isinstance(loader, collections.abc.Iterator)]
        if one_shot or not _compat.can_restart_training_iterator(trainer):
            why = (
                f"a training loader is an iterator, which cannot start again ({', '.join(one_shot)})" if one_shot
                else "this Lightning keeps it where it cannot be made again"
            )
            self._warn_training_loaders_not_prepared(why)
            return
        for loader in prepared:  # every one: the new iterator reads them all from their start again
            self._prepare_first_epoch(loader, trainer)
        _compat.restart_training_iterator(trainer)

    def _warn_training_loaders_not_prepared(self, why: str) -> None:
        rank_zero_warn(
            f"{type(self).__name__}: the training loaders were set up before the checkpoint this fit resumes restored"
            " the loops (reading trainer.estimated_stepping_batches in a setup, configure_model, configure_optimizers"
            f" or on_fit_start hook does it), and could not be prepared for it: {why}. They start as they were"
            " set up then: after a mid-epoch checkpoint, batches trained before it may be trained again, and"
            " stateful loaders start over. Read it in configure_optimizers, where samplers of ours are set up at the"
            " checkpoint's position."
        )

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self._attached_trainer
        # A strategy that restores its optimizers itself (lightning_restore_optimizer False) never calls
        # load_optimizer_state_dict. A tuner's inner fit, before the restore, does not restart.
        if (
            trainer is not None and self._trained_loader_set_up_before_restore and not self._restored
            and trainer.ckpt_path is not None and trainer.fit_loop.restarting
        ):
            self._warn_training_loaders_not_prepared("load_optimizer_state_dict was not called after the restore")
        self._warn_of_unfinished_epoch(trainer)
        closed = _compat.close_epoch_restored_after_its_last_batch(trainer) if trainer is not None else None
        if closed is not None:
            rank_zero_info(
                f"{type(self).__name__}: the checkpoint was written after the last of its epoch's {closed[0]} batches;"
                f" the next epoch has {closed[1]} and is trained from its first."
            )

    def _warn_of_unfinished_epoch(self, trainer: Optional[Trainer]) -> None:
        """Warn when the fit resumes, by ``max_epochs`` alone, from a checkpoint written after a fit stopped inside
        an epoch (see ``_compat.epoch_left_unfinished``): Lightning starts the next epoch, and the rest of that one
        is never trained, silently, with any strategy. Called as training starts, once Lightning has counted the
        epoch's batches (``num_training_batches``), which an epoch that ``limit_train_batches`` ended reaches."""
        unfinished, self._unfinished_epoch = self._unfinished_epoch, None
        if trainer is None or unfinished is None or unfinished[1] >= trainer.num_training_batches:
            return
        epoch, done = unfinished
        rank_zero_warn(
            f"{type(self).__name__}: the checkpoint was written after the fit stopped inside epoch {epoch}, {done}"
            " batch(es) into it on each rank (trainer.should_stop: a Timer, max_time or EarlyStopping; or max_steps)."
            f" Resumed by max_epochs alone, Lightning starts epoch {epoch + 1}: the rest of epoch {epoch} is not"
            " trained (with any strategy). To train it, resume with max_steps set (Lightning then goes on with that"
            " epoch's remaining batches), or from a checkpoint written inside the epoch"
            " (ModelCheckpoint(every_n_train_steps=...))."
        )

    @override
    def on_train_end(self) -> None:
        # The last epoch's whole sequence, which no next epoch's first step compares.
        if self.check_sampler_consistency:
            self._verify(RunningStage.TRAINING)
        super().on_train_end()

    @override
    def on_validation_start(self) -> None:
        self._evaluating = True
        self._counts_at_start = self._evaluation_counts()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._evaluating = True
        self._counts_at_start = self._evaluation_counts()
        super().on_test_start()

    def _evaluation_counts(self) -> _compat.EvaluationCounts:
        trainer = self._attached_trainer
        return _compat.NO_COUNTS if trainer is None else _compat.evaluation_counts(trainer)

    @override
    def on_validation_end(self) -> None:
        self._evaluating = False
        if self.check_sampler_consistency:
            self._verify(RunningStage.VALIDATING)
        super().on_validation_end()

    @override
    def on_test_end(self) -> None:
        self._evaluating = False
        if self.check_sampler_consistency:
            self._verify(RunningStage.TESTING)
        super().on_test_end()

    # ------------------------------------------------------------------ evaluation
    def _evaluation_loader(self, dataloader_idx: int) -> DataLoader:
        trainer = self._attached_trainer
        if trainer is None or not (trainer.validating or trainer.testing or trainer.sanity_checking):
            raise RuntimeError("evaluated_indices()/gather_in_order() work during validation or test only.")
        loaders = _compat.current_loaders(trainer, RunningStage.TESTING if trainer.testing else RunningStage.VALIDATING)
        if not 0 <= dataloader_idx < len(loaders):
            raise IndexError(f"dataloader_idx {dataloader_idx} out of range: there are {len(loaders)} loaders.")
        loader = loaders[dataloader_idx]
        if not isinstance(loader, DataLoader):
            raise TypeError(f"evaluation loader {dataloader_idx} is a {type(loader).__name__}, not a DataLoader.")
        return loader

    def evaluated_indices(self, dataloader_idx: int = 0) -> List[int]:
        """The dataset indices of the samples this rank evaluated from loader ``dataloader_idx`` in this run, in
        order, padding excluded.

        The strategy dealt them, so a LightningModule needs no index bookkeeping of its own: outputs collected in
        ``validation_step`` line up with these indices. Batches a limit or the sanity check left unevaluated are
        not included; inside a batch (or a step that takes ``dataloader_iter``), where that count is not known,
        every index the loader yielded so far is (the first ``len(outputs)`` of them line up).
        """
        indices = self._yielded_indices(dataloader_idx)
        evaluated = self._evaluated_samples(dataloader_idx)  # padding included: it comes after the real samples
        return indices if evaluated is None else indices[:evaluated]

    def _yielded_indices(self, dataloader_idx: int) -> List[int]:
        """The dataset indices evaluation loader ``dataloader_idx`` yielded in this run, padding excluded."""
        trainer = self._attached_trainer
        if trainer is not None and _compat.evaluation_combine_mode(trainer) == "max_size_cycle":
            raise RuntimeError(
                "evaluated_indices() and gather_in_order() cannot follow an evaluation CombinedLoader in mode"
                " 'max_size_cycle': its shorter loaders start over within the run, so their samples repeat and the"
                " earlier rounds are not kept. Use mode 'max_size' (a loader that ran out gives None) or 'sequential'."
            )
        loader = self._evaluation_loader(dataloader_idx)
        wrapper = wrapper_of(loader)
        if wrapper is not None:
            if not wrapper.record_yielded:
                raise RuntimeError(
                    f"evaluation loader {dataloader_idx} is a training loader too, so it does not keep what it yields"
                    " (a whole training epoch's share): give validation a loader of its own to use"
                    " evaluated_indices() or gather_in_order()."
                )
            return recorded_indices(wrapper)
        sampler = index_sampler(loader)
        if isinstance(sampler, DistributedSampler):
            return distributed_sampler_share(sampler)
        raise RuntimeError(
            f"{type(self).__name__} did not shard this loader ({type(sampler).__name__}), so it cannot tell which"
            " samples this rank evaluated; track the indices yourself and use lightning_ddp_ext.sync.gather_in_order."
        )

    def gather_in_order(self, values: Any, dataloader_idx: int = 0) -> Any:
        """All ranks' per-sample ``values`` of this evaluation run, in dataset order, each sample once.

        ``values`` are this rank's outputs in the order its loader yielded the samples (a tensor with one row
        per sample, or a list), one for each sample of the batches it evaluated in this run, padding included:
        anything else (per-batch outputs, a batch left out) raises ``ValueError`` on every rank (a step that takes
        the ``dataloader_iter`` is not checked: it may read any number of batches). Padding repeats are dropped
        before gathering. Call it on every rank, e.g. from ``on_validation_epoch_end``, not inside a batch with
        ``eval_mode="exact"`` (refused, as other collectives are there).
        """
        self._refuse_collective_inside_exact_evaluation("gather_in_order")
        indices = self.evaluated_indices(dataloader_idx)
        evaluated = self._evaluated_samples(dataloader_idx)
        # A dict, a set or a generator would not even slice: raised on every rank by the exchange, not here alone.
        not_samples = _not_samples_error(values, sized=True)
        if not_samples is not None:
            return _gather_in_order(values, indices, problem=not_samples)
        problem: Optional[Exception] = None
        try:
            given = len(values)
        except TypeError:  # a 0-dim tensor: sync's own check raises on every rank
            return _gather_in_order(values, indices)
        if evaluated is None:  # not known (inside a batch, a dataloader_iter step): as many as values has
            evaluated = given
        elif given != evaluated:
            hint = _PER_BATCH_HINT if _looks_per_batch(values, evaluated) else (
                "pass one value per evaluated sample (row), from every batch, in the order the batches came: values"
                " that leave out a batch would be filed under the wrong indices"
            )
            problem = ValueError(
                f"gather_in_order got {given} values for evaluation loader {dataloader_idx}, but this rank"
                f" evaluated {evaluated} samples of it in this run; {hint}"
            )
        count = min(evaluated, len(indices))  # fewer batches than dealt (sanity check, limits) or padding left out
        return _gather_in_order(values[:count], indices[:count], problem=problem)

    def _evaluated_samples(self, dataloader_idx: int) -> Optional[int]:
        """How many samples, padding included, the batches of loader ``dataloader_idx`` evaluated so far in this
        run hold; None inside a batch or where the loader's batches are not known."""
        trainer = self._attached_trainer
        batches = None if trainer is None else _compat.evaluated_batches(trainer, dataloader_idx, self._counts_at_start)
        if batches is None:
            return None
        return samples_in_first_batches(self._evaluation_loader(dataloader_idx), batches)

    def _refuse_collective_inside_exact_evaluation(self, name: str) -> None:
        trainer = self._attached_trainer
        if self.eval_mode != "exact" or not self._evaluating or trainer is None:
            return
        if _compat.inside_evaluation_batch(trainer):
            raise RuntimeError(
                f"{name}() was called inside a validation/test batch (its step or its batch hooks) with"
                f" {type(self).__name__}(eval_mode='exact'):"
                " ranks evaluate different numbers of batches in that mode, so a per-step collective would hang."
                " Move it to on_validation_epoch_end (self.log(..., on_step=False, on_epoch=True) is fine), or use"
                " eval_mode='pad'."
            )

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Lightning's reduce, with the mean of an integer tensor computed in floating point.

        Lightning divides an integer sum by the world size in place, truncating: ``self.log(...,
        on_epoch=True, sync_dist=True)`` divides the mean of the ranks' sums by the truncated mean of their
        integer sample counts, a wrong value whenever ranks saw different numbers of samples (always possible
        with ``eval_mode="exact"`` or batch samplers of varying batch sizes).
        """
        self._refuse_collective_inside_exact_evaluation("reduce")
        integer = isinstance(tensor, torch.Tensor) and not (tensor.is_floating_point() or tensor.is_complex())
        if integer and _is_mean(reduce_op):
            mean = super().reduce(tensor.to(torch.float64), group=group, reduce_op=reduce_op)  # exact to 2**53
            # Lightning's logged values: the default dtype, but never below float32 (half-precision plugins
            # lower the default inside steps, where 1001 would round to 1000 in bfloat16).
            default = torch.get_default_dtype()
            return mean.to(default if default in (torch.float32, torch.float64) else torch.float32)
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        self._refuse_collective_inside_exact_evaluation("all_gather")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_collective_inside_exact_evaluation("barrier")
        super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._refuse_collective_inside_exact_evaluation("broadcast")
        return super().broadcast(obj, src)

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register :attr:`registry_entries`; names already registered to this class are left alone.

        A subclass registers names of its own: it must define ``registry_entries`` itself (the inherited ones are
        its parent's names, which it would take over).
        """
        if "registry_entries" not in cls.__dict__:
            names = [name for name, _ in cls.registry_entries]
            raise ValueError(
                f"{cls.__name__}.register_strategies would register {cls.__name__} under its parent's names {names}."
                f" Give {cls.__name__} names of its own, e.g. registry_entries = (('my_ddp', {{'start_method':"
                " 'popen'}),), then call register_strategies."
            )
        taken = {}  # name -> the class registered under it, where that is neither cls nor a reloaded copy of it
        for name, _ in cls.registry_entries:
            registered = (dict.get(strategy_registry, name) or {}).get("strategy")
            if registered is not None and (registered.__module__, registered.__qualname__) != (
                cls.__module__,
                cls.__qualname__,
            ):
                taken[name] = registered.__qualname__
        if taken:  # checked before registering any, so that nothing is half done
            raise ValueError(
                f"Strategy names already registered to other classes: {taken}. Choose other names in"
                f" {cls.__name__}.registry_entries, or remove them first (StrategyRegistry.remove(name)) to replace"
                " them."
            )
        for name, init_params in cls.registry_entries:
            entry = dict.get(strategy_registry, name)
            if entry is not None and entry["strategy"] is cls:  # ours, perhaps re-registered with options of the
                continue  # user's: left as it is (a reloaded copy of the class is registered anew)
            strategy_registry.register(
                name,
                cls,
                description=f"{cls.__name__} ({cls.__module__}) with {init_params}",
                override=entry is not None,
                **init_params,
            )

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        _compat.use_clear_error_launcher(self)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Rewrite cryptic DDP errors into advice; on the launching rank, end the ranks it started.

        Lightning's popen launcher ends the other ranks when a child fails, but not when the launching rank
        does: a rank stuck outside any collective would then run on, orphaned. They are killed here instead.
        """
        self._evaluating = False  # the evaluation, if one ran, ends here without its end hook
        self._drop_pending_skips()  # Lightning 2.2 does not tear down after a KeyboardInterrupt
        killed = _compat.kill_launched_ranks(self)
        if killed:
            log.error(f"{type(self).__name__}: rank {self.global_rank} failed; ended the {killed} rank(s) it launched.")
        message = str(exception)
        if "Expected to have finished reduction in the prior iteration" in message:
            popen = self._start_method == "popen"  # the one start method that has a registered name for this
            exception.args = (
                message + "\nYour LightningModule has parameters that did not contribute to the loss. If that is"
                " intended, use "
                + ("strategy='ddp_custom_sampler_find_unused_parameters_true' or " if popen else "")
                + f"{type(self).__name__}(find_unused_parameters=True"
                + ("" if popen else f", start_method={self._start_method!r}")
                + ").",
            ) + exception.args[1:]
