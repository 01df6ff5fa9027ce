"""``CustomDDPSharded``: CustomDDP with fairscale's optimizer-state and gradient sharding (OSS + ShardedDataParallel).

Lightning 1.x had ``ddp_sharded``; a straight port of it onto Lightning 2.x trains wrongly without an error.
Each override below exists for one of those failures and says which; ``tests/test_sharded.py`` has a test for
each that fails without it. fairscale is optional (``pip install "lightning_ddp_ext[sharded]"``) and imported
only when this strategy is constructed or used.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import math
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple, cast

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import TypeGuard, override

from lightning_ddp_ext import _compat
from lightning_ddp_ext.dataloader import _MISSING, _same_value
from lightning_ddp_ext._windows import splitmix64
from lightning_ddp_ext.strategy import CustomDDP

if TYPE_CHECKING:
    from fairscale.optim import OSS

__all__ = [
    "CustomDDPSharded",
    "balanced_partition",
    "clip_grad_norm_of_shards",
    "fairscale_available",
    "rank_synchronised_scaler",
    "require_every_rank",
    "shard_optimizer",
]

INSTALL_HINT = 'pip install "lightning_ddp_ext[sharded]"'

#: Constructor arguments of DDPStrategy that only mean something for torch's DistributedDataParallel.
_DDP_ONLY_STRATEGY_ARGUMENTS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


def fairscale_available() -> bool:
    """Whether fairscale can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("fairscale") is not None
    except (ImportError, ValueError):
        return False


def _fairscale() -> Tuple[type, type]:
    """``(OSS, ShardedDataParallel)``, or an ImportError that says what to install."""
    try:
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim import OSS
    except ModuleNotFoundError as error:
        if (error.name or "fairscale").split(".")[0] != "fairscale":
            raise
        raise ImportError(f"CustomDDPSharded needs fairscale, which is not installed: {INSTALL_HINT}") from error
    return OSS, ShardedDataParallel


def _wrapper_options() -> Tuple[str, ...]:
    """The keyword arguments users may pass to ShardedDataParallel (``process_group`` is the strategy's)."""
    _, sharded_data_parallel = _fairscale()
    names = inspect.signature(sharded_data_parallel).parameters
    return tuple(name for name in names if name not in ("module", "sharded_optimizer", "process_group"))


# ---------------------------------------------------------------------------------------------- partition
def balanced_partition(
    param_groups: Sequence[Mapping[str, Any]],
    world_size: int,
    largest_first: bool = True,
    keep: Optional[Mapping[torch.Tensor, int]] = None,
) -> List[List[Dict[str, Any]]]:
    """Assign every parameter to one rank: each, largest first, to the rank that holds the fewest elements so far.

    fairscale's OSS does the same greedy assignment in parameter order, so one large tensor that comes late
    (or an embedding that comes first) leaves a rank with far more than its share: 1.195x the ideal on a small
    transformer. Taking the largest first is the classic LPT rule (torch's ZeroRedundancyOptimizer sorts the
    same way). Frozen parameters weigh 1, as in OSS: they have no optimizer state.

    Args:
        param_groups: the optimizer's parameter groups.
        world_size: number of ranks.
        largest_first: False reproduces fairscale's own partition (for comparison).
        keep: parameters that stay on the rank they map to (an earlier partition); only the others are
            assigned, onto the ranks' loads including the kept ones.

    Returns:
        One list per rank with a copy of every group (also of groups where the rank owns nothing, so that
        OSS can pair its groups with the shard optimizer's one to one), holding the parameters that rank owns
        in their original order: the shape of ``OSS.partition_parameters()``.

    Example:
        >>> from torch.nn import Parameter
        >>> sizes = [1, 8, 2, 7]
        >>> groups = [{"params": [Parameter(torch.zeros(n)) for n in sizes], "lr": 0.1}]
        >>> [[p.numel() for p in rank[0]["params"]] for rank in balanced_partition(groups, 2)]
        [[1, 8], [2, 7]]
        >>> [[p.numel() for p in rank[0]["params"]] for rank in balanced_partition(groups, 2, largest_first=False)]
        [[1, 2, 7], [8]]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")

    def weight(param: torch.Tensor) -> int:
        return param.numel() if param.requires_grad else 1

    keep = keep or {}
    entries = [(g, i, p) for g, group in enumerate(param_groups) for i, p in enumerate(group["params"])]
    loads = [0] * world_size
    owner: Dict[Tuple[int, int], int] = {}
    for g, i, param in entries:
        if param in keep:
            owner[(g, i)] = keep[param]
            loads[keep[param]] += weight(param)
    entries = [entry for entry in entries if (entry[0], entry[1]) not in owner]
    if largest_first:
        entries.sort(key=lambda entry: -weight(entry[2]))  # stable: equal sizes keep parameter order
    for g, i, param in entries:
        rank = loads.index(min(loads))
        owner[(g, i)] = rank
        loads[rank] += weight(param)
    return [
        [
            {**group, "params": [p for i, p in enumerate(group["params"]) if owner[(g, i)] == rank]}
            for g, group in enumerate(param_groups)
        ]
        for rank in range(world_size)
    ]


@functools.lru_cache(maxsize=None)
def _balanced_oss_class() -> type:
    """fairscale's OSS with :func:`balanced_partition`; built on first use so that fairscale stays optional."""
    oss_class, _ = _fairscale()

    class BalancedOSS(oss_class):  # type: ignore[misc, valid-type]
        """OSS whose partition takes the largest parameters first, and which follows replaced parameter groups.

        The parameter groups keep the user's parameter order, so ``state_dict()`` (consolidated) indexes
        parameters exactly as the unsharded optimizer does and checkpoints stay interchangeable with CustomDDP.

        A parameter keeps its rank once assigned. OSS recomputes the partition when a group is added
        (``add_param_group``, as Lightning's ``BaseFinetuning`` does) but only appends the new group to the
        shard optimizer, so it relies on the old assignments staying put, as its in-order partition does.
        Re-sorting all parameters would move some: the shard optimizer would no longer step them (and their
        state would stay behind), while the rank that now owns them broadcasts them unchanged.

        ``param_groups`` may also be replaced outside ``add_param_group``: on resume, ``BaseFinetuning``
        assigns ``optimizer.param_groups`` with the groups it had added. fairscale's OSS keeps its old
        partition then: loading Adam's state raised ``KeyError: Parameter containing ...``, and SGD never
        stepped the restored groups. Every entry point (``step``, ``load_state_dict``, ``state_dict``,
        ``consolidate_state_dict``, ``add_param_group``, ``refresh_trainable``, ``clip_grad_norm``) first
        compares the groups with those partitioned and, where they differ, partitions again (keeping the
        owners of parameters already assigned) and rebuilds the shard optimizer's groups and the flat buffers.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._owners: Dict[torch.Tensor, int] = {}  # every partitioned parameter -> its rank
            # The groups' parameters when the partition was last computed (held, so that their ids stay theirs).
            self._partitioned: List[List[torch.Tensor]] = []
            super().__init__(*args, **kwargs)

        @override
        def partition_parameters(self) -> List[List[Dict[str, Any]]]:
            # OSS caches the partition in this list and clears it when parameters change.
            if len(self._partition_parameters) == 0:  # type: ignore[has-type]
                partition = balanced_partition(self.param_groups, self.world_size, keep=self._owners)
                self._owners = {p: rank for rank, groups in enumerate(partition) for g in groups for p in g["params"]}
                self._partition_parameters = partition
                self._partitioned = [list(group["params"]) for group in self.param_groups]
            return self._partition_parameters

        def _sync_partition(self) -> None:
            """Partition again if ``param_groups`` no longer hold the parameters partitioned (see the class)."""
            if self.in_super_constructor or not hasattr(self, "optim"):  # still being built
                return
            current = [[id(p) for p in group["params"]] for group in self.param_groups]
            if current == [[id(p) for p in params] for params in self._partitioned]:
                return
            self._clear_cache()
            local = self.partition_parameters()[self.rank]  # parameters partitioned before keep their rank
            owned = {p for group in local for p in group["params"]}
            for param in [p for p in self.optim.state if p not in owned]:  # parameters no longer in any group
                del self.optim.state[param]
            # One shard group per group, in order: OSS pairs them by position. State is keyed by parameter.
            self.optim.param_groups = []
            for group in local:
                self.optim.add_param_group(group)
            self._sync_param_groups(self.param_groups, self.optim.param_groups)  # OSS's staticmethod
            self.buckets.clear()  # the flat broadcast buffers, rebuilt over the new partition
            self._setup_flat_buffers()

        @override
        def step(self, closure: Any = None, **kwargs: Any) -> Any:
            self._sync_partition()
            return super().step(closure, **kwargs)

        @override
        def add_param_group(self, param_group: Dict[str, Any]) -> None:
            self._sync_partition()
            super().add_param_group(param_group)

        @override
        def refresh_trainable(self) -> None:
            self._sync_partition()
            super().refresh_trainable()

        @override
        def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
            self._sync_partition()
            super().consolidate_state_dict(recipient_rank)

        @override
        def state_dict(self, all_ranks: bool = False) -> Dict[str, Any]:
            self._sync_partition()
            return cast(Dict[str, Any], super().state_dict(all_ranks))

        @override
        def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
            self._sync_partition()
            super().load_state_dict(state_dict)

        @override
        def clip_grad_norm(
            self, max_norm: float, norm_type: float = 2.0, filter_params_fn: Optional[Any] = None
        ) -> torch.Tensor:
            """:func:`clip_grad_norm_of_shards`: fairscale's misses parameters without a gradient at its first call."""
            return clip_grad_norm_of_shards(self, max_norm, norm_type, filter_params_fn)

    BalancedOSS.__module__, BalancedOSS.__qualname__ = __name__, "BalancedOSS"
    return BalancedOSS


# ---------------------------------------------------------------------------------------------- optimizers
def constructor_defaults(optimizer_class: type, defaults: Mapping[str, Any]) -> Dict[str, Any]:
    """The entries of ``defaults`` that ``optimizer_class(params, **entries)`` accepts.

    An optimizer's ``defaults`` may hold keys its constructor does not take (torch's AdamW records
    ``decoupled_weight_decay``), so ``OSS(..., optim=cls, **opt.defaults)`` raises TypeError. Dropped keys
    lose nothing: every parameter group carries its own copy of them.
    """
    parameters = inspect.signature(optimizer_class).parameters
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return dict(defaults)
    return {key: value for key, value in defaults.items() if key in parameters}


def shard_optimizer(optimizer: Optimizer, group: Optional[Any] = None) -> "OSS":
    """``optimizer`` rebuilt as an OSS of the same class, parameter groups and defaults; an OSS is returned as is.

    Build it before the optimizer has state: state is not carried over (Lightning restores checkpoints after
    the strategy's setup, into the new optimizer).

    Args:
        optimizer: a torch optimizer built by ``configure_optimizers``.
        group: the process group to shard over (default: the whole world).

    Raises:
        ValueError: the optimizer has no parameter groups (``configure_optimizers`` returned no optimizer).
        TypeError: the optimizer class cannot be rebuilt from its parameter groups and defaults (an option kept
            outside them), or cannot be sharded at all (``LBFGS``).
    """
    oss_class, _ = _fairscale()
    stepping = cast(Any, optimizer).optim if isinstance(optimizer, oss_class) else optimizer
    if isinstance(stepping, torch.optim.LBFGS):
        raise TypeError(
            f"CustomDDPSharded cannot shard {type(stepping).__name__}: its steps take inner products over all"
            " parameters (curvature pairs, line search), and each rank's shard holds only some of them, so it would"
            " train on wrong steps without an error. Use CustomDDP, which steps every parameter on every rank."
        )
    if isinstance(optimizer, oss_class):
        return optimizer
    optimizer_class = type(optimizer)
    if not optimizer.param_groups:
        raise ValueError(
            f"{optimizer_class.__name__} has no parameters to shard: CustomDDPSharded needs configure_optimizers to"
            " return an optimizer. Use CustomDDP for a fit without one."
        )
    groups = [{**param_group, "params": list(param_group["params"])} for param_group in optimizer.param_groups]
    defaults = constructor_defaults(optimizer_class, optimizer.defaults)
    try:
        sharded = _balanced_oss_class()(groups, optim=optimizer_class, group=group, **defaults)
    except TypeError as error:
        raise _cannot_rebuild(optimizer_class, str(error)) from error
    lost = _option_lost_in_rebuilding(optimizer, sharded.optim)
    if lost is not None:
        raise _cannot_rebuild(optimizer_class, lost)
    return sharded


def _cannot_rebuild(optimizer_class: type, why: str) -> TypeError:
    return TypeError(
        f"CustomDDPSharded could not rebuild {optimizer_class.__name__} as a fairscale OSS shard ({why}). Return"
        f" fairscale.optim.OSS(params, optim={optimizer_class.__name__}, ...) from configure_optimizers yourself;"
        " an OSS optimizer is used as it is."
    )


def _option_lost_in_rebuilding(original: Optimizer, rebuilt: Optimizer) -> Optional[str]:
    """Why ``rebuilt`` (from ``original``'s parameter groups and defaults) steps differently, or None.

    An option an optimizer keeps as a public attribute rather than in ``defaults`` (``self.max_update = ...``)
    would fall back to its default in the rebuilt optimizer, silently. torch's own optimizers keep none; private
    attributes are their bookkeeping (``LBFGS._params``, which the shard holds fewer of), and a method patched on
    the instance (torch's LR schedulers wrap ``step`` so) is not an option: neither is compared.
    """
    for name, value in vars(original).items():
        if name.startswith("_") or name in ("defaults", "param_groups", "state"):
            continue
        if callable(value) and hasattr(type(original), name):
            continue
        other = vars(rebuilt).get(name, _MISSING)
        if not _same_option(value, other):
            shown = "missing" if other is _MISSING else repr(other)
            return f"its attribute {name!r} is {value!r}, not in its defaults, and would be {shown} in the rebuilt one"
    return None


def _same_option(first: Any, second: Any) -> bool:
    """:func:`~lightning_ddp_ext.dataloader._same_value`, and equal tensors (an option built anew) are the same."""
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        return first.shape == second.shape and bool(torch.equal(first, second))
    return _same_value(first, second)


def _repoint(schedulers: Sequence[Any], old: Optimizer, new: Optimizer) -> bool:
    """Point every scheduler of ``old`` at ``new``, those nested in SequentialLR and ChainedScheduler too.

    Those two step their child schedulers (``_schedulers``, torch's private attribute, checked on torch 2.13),
    each of which writes into its own ``optimizer``. Returns whether any scheduler was re-pointed.
    """
    moved = False
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is old:
            scheduler.optimizer = new
            moved = True
        moved |= _repoint(getattr(scheduler, "_schedulers", ()), old, new)
    return moved


def _point_schedulers_at(schedulers: Sequence[Any], old: Optimizer, new: Optimizer) -> None:
    """Make the LR schedulers of ``old`` adjust ``new``, which OSS syncs into its shard optimizer at each step.

    torch's LRScheduler wraps ``optimizer.step`` to record that it ran, and warns when a scheduler steps an
    optimizer whose step is not wrapped; ``new``'s step gets the same wrapper (torch's private protocol,
    checked on torch 2.13: ``step._wrapped_by_lr_sched`` and ``optimizer._opt_called``; where it differs,
    the only effect is one spurious warning).
    """
    moved = _repoint(schedulers, old, new)
    if not moved or not hasattr(old.step, "_wrapped_by_lr_sched") or hasattr(new.step, "_wrapped_by_lr_sched"):
        return
    reference = weakref.ref(new)  # no cycle through the bound method, as in torch
    step = type(new).step

    @functools.wraps(step)
    def counted_step(*args: Any, **kwargs: Any) -> Any:
        optimizer = reference()
        assert optimizer is not None
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(optimizer, *args, **kwargs)

    counted_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    new.step = counted_step  # type: ignore[method-assign]


def _reduce_added_parameters(wrapper: Module) -> None:
    """Make ShardedDataParallel reduce the gradients of parameters added to its optimizers after wrapping.

    SDP lists the parameters it reduces once, from its optimizers, when it is built (``_all_params``). A group
    added later (``add_param_group``, as Lightning's ``BaseFinetuning`` does, or restored on resume by assigning
    ``param_groups``) kept each rank's own gradient: its owner stepped on its local batch only. This brings the
    partitions of :class:`BalancedOSS` optimizers up to date, then re-lists the parameters and rebuilds SDP's
    hooks if they changed (fairscale's private attributes, checked on fairscale 0.4.13); it costs one pass over
    the parameters per step when nothing changed.
    """
    _, sharded_data_parallel = _fairscale()
    if not isinstance(wrapper, sharded_data_parallel):  # configure_ddp was overridden to return another wrapper
        return
    sdp: Any = wrapper
    optimizers: List["OSS"] = sdp._sharded_optimizers
    for optimizer in optimizers:
        sync_partition = getattr(optimizer, "_sync_partition", None)
        if callable(sync_partition):
            sync_partition()
    listed = [
        param
        for optimizer in optimizers
        for per_rank in optimizer._per_device_params.values()
        for params in per_rank
        for param in params
    ]
    trainable = [param.requires_grad for param in listed]
    if [id(param) for param in listed] == [id(param) for param in sdp._all_params]:
        if trainable != sdp._reference_trainable_mask:  # (un)frozen since SDP last looked; it refreshes in forward
            _refuse_shared_parameters(optimizers, sdp.module)
        return
    _refuse_shared_parameters(optimizers, sdp.module)
    sdp._all_params = listed
    sdp._reference_trainable_mask = trainable
    sdp.refresh_trainable()


def _refuse_shared_parameters(optimizers: Sequence[Optimizer], model: Module) -> None:
    """Raise when a trainable parameter is in two optimizers, or twice in one: each OSS shard optimizer steps and
    broadcasts its own partition, and ShardedDataParallel hooks a parameter once per listing, so it would get two
    owners, two reductions, and wrong steps without an error (then a fairscale AssertionError). A frozen one is
    left alone (nothing steps it; its owners broadcast the same values) until it is unfrozen."""
    seen: Set[int] = set()
    shared: Dict[int, torch.Tensor] = {}  # by id, in the order first found shared
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad and id(param) in seen:
                    shared.setdefault(id(param), param)
                seen.add(id(param))
    if not shared:
        return
    listing = ", ".join(_parameter_name(model, param) for param in list(shared.values())[:5])
    more = f" and {len(shared) - 5} more" if len(shared) > 5 else ""
    raise ValueError(
        f"CustomDDPSharded cannot shard a trainable parameter that is in more than one optimizer, or twice in one"
        f" ({listing}{more}): each fairscale OSS optimizer steps and broadcasts its own share, so such a parameter"
        " would get two owners and train wrong. Give each parameter to one optimizer, once (or freeze it), or use"
        " CustomDDP, whose optimizers step every parameter on every rank."
    )


def _parameter_name(model: Module, param: torch.Tensor) -> str:
    names = (name for name, known in model.named_parameters(remove_duplicate=False) if known is param)
    return next(names, f"a parameter of shape {tuple(param.shape)}")


def _sparse_gradient_error(model: Module, param: torch.Tensor) -> RuntimeError:
    return RuntimeError(
        f"CustomDDPSharded cannot reduce the sparse gradient of {_parameter_name(model, param)} (an nn.Embedding or"
        " nn.EmbeddingBag with sparse=True, say): fairscale's ShardedDataParallel reduces each gradient"
        " with torch.distributed.reduce, which has no sparse kernel. Make the gradient dense (sparse=False), or"
        " use CustomDDP, which all-reduces sparse gradients."
    )


@functools.lru_cache(maxsize=None)
def _sharded_data_parallel_class() -> type:
    """fairscale's ShardedDataParallel, reducing at every backward pass the strategy runs; built on first use
    (fairscale is optional)."""
    _, sharded_data_parallel = _fairscale()

    # fairscale's class name, kept: code that checks `type(trainer.model).__name__` goes on working.
    class ShardedDataParallel(sharded_data_parallel):  # type: ignore[misc, valid-type]
        """ShardedDataParallel that reduces the gradients of every backward pass the strategy runs.

        SDP arms its reduction (``_clear_counters``) in ``forward`` only. A second backward pass after one forward
        (manual optimization with two optimizers, GAN style) reduced only the parameters the first had not, and
        queued no wait for those reductions: the second optimizer stepped on unreduced gradients, without an
        error. Here SDP's end-of-backward callback (``_flush_reduce_calls``, which waits for the reductions)
        marks the backward pass done, and the first gradient of the next backward pass arms the reduction again,
        if the strategy runs it (``reduce_every_backward``, set by ``CustomDDPSharded.backward``: Lightning's
        ``manual_backward`` and automatic optimization), which also disarms, once it ends, the parameters it did
        not reach (forward arms them all). Any other backward pass reaching the parameters (one in
        ``validation_step``, one on the bare module after ``fit``) stays local; reducing it would make ranks that
        run different numbers of them wait for each other. The strategy also disarms the wrapper when a training
        step ends (a manual-optimization step may skip its backward). A plain ``loss.backward()`` in manual
        optimization is not supported: the first of a step is reduced (every rank must run it), one after a
        ``manual_backward`` stays local, silently.
        Within one backward pass a parameter is reduced at its first gradient only: one used both inside and
        outside a reentrant ``checkpoint`` segment (a nested backward pass) gets a wrong gradient, as with
        fairscale's wrapper (non-reentrant checkpointing is fine).

        The re-arming runs in SDP's own reduce hook (``_get_reduce_fn``), before it reduces: no hook of its own.

        A gradient that accumulates onto a reduced one (two backward passes without ``zero_grad`` between them)
        must become ``reduced + mean(new)``. Its owner holds the reduced gradient and the other ranks none, so
        the owner's is multiplied by the world size just before the new gradient is added: the reduction, a sum
        divided by the world size, then gives that. That needs a hook before accumulation, on the parameters
        this rank owns only (and none on one rank, where the factor is 1). fairscale's private attributes,
        checked on fairscale 0.4.13.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._group_size = dist.get_world_size(self._process_group)
            self._backward_done = False  # set at the end of a backward pass that reduced gradients
            self.reduce_every_backward = False  # set by the strategy around the backward passes it runs
            self._holding_reduced: set = set()  # parameters whose gradient here is the reduced one
            self._accumulation_hooks: List[Any] = []

        @override
        def _setup_backward_hooks(self) -> None:
            super()._setup_backward_hooks()
            while self._accumulation_hooks:
                self._accumulation_hooks.pop().remove()
            if not self.training or self._group_size == 1:  # as SDP: no hooks in eval mode; one rank: factor 1
                return
            for param in self._trainable_params:
                if self._trainable_param_to_rank[param] != self._global_rank:  # only owners hold reduced gradients
                    continue
                view = param.expand_as(param)
                if view.grad_fn is not None:  # the node SDP hooks (and keeps alive), before it accumulates
                    accumulator = view.grad_fn.next_functions[0][0]
                    self._accumulation_hooks.append(accumulator.register_prehook(self._before_accumulating(param)))

        def _before_accumulating(self, param: torch.Tensor) -> Any:
            # No torch.no_grad(): autograd runs hooks with grad mode off (SDP refuses create_graph gradients).
            def hook(grad_outputs: Any) -> None:
                if self.reduce_every_backward and param in self._holding_reduced:
                    self._holding_reduced.discard(param)
                    if param.grad is not None:
                        param.grad.mul_(self._group_size)

            return hook

        @override
        def _get_reduce_fn(self, index: int, param: torch.Tensor, dst_rank: int) -> Any:
            reduce = super()._get_reduce_fn(index, param, dst_rank)

            def rearm_then_reduce(*args: Any) -> None:
                if param.grad is not None and param.grad.layout is not torch.strided:
                    raise _sparse_gradient_error(self.module, param)  # every rank alike: the model is the same on each
                if self._backward_done and self.reduce_every_backward:  # the first gradient of a new backward pass
                    self._backward_done = False
                    self._grad_to_be_reduced = [True for _ in self._trainable_params]
                    self._bucket_flush_callback_set = False
                reduce(*args)

            return rearm_then_reduce

        @override
        def _flush_reduce_calls(self) -> None:
            super()._flush_reduce_calls()  # waits for every reduction of this backward pass
            for index, param in enumerate(self._trainable_params if self._group_size > 1 else ()):
                # the rank whose gradient SDP keeps after the reduction (its `cleanup`)
                if not self._grad_to_be_reduced[index] and self._trainable_param_to_rank[param] == self._global_rank:
                    self._holding_reduced.add(param)
            self._backward_done = True
            if self._group_size > 1:
                self._check_same_parameters_reduced()

        def _check_same_parameters_reduced(self) -> None:
            """Raise, on every rank alike, when the ranks' backward passes reduced different parameters.

            SDP reduces each gradient as soon as it is ready, and the process group pairs the ranks' reductions
            in the order they are made: ranks that take different branches (a head per task, experts) pair one
            parameter's gradient with another's, and step on wrong gradients without an error. One all-reduce of
            a fingerprint of the reduced parameters per backward pass tells."""
            reduced = torch.tensor([not pending for pending in self._grad_to_be_reduced], dtype=torch.bool)
            fingerprint = int(_parameter_weights(len(reduced))[reduced].sum())
            extremes = torch.tensor([fingerprint, -fingerprint], device=self._trainable_params[0].device)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self._process_group)
            if int(extremes[0]) != -int(extremes[1]):
                raise RuntimeError(
                    "CustomDDPSharded: the ranks' backward passes reached different parameters (this rank reduced"
                    f" {int(reduced.sum())} of {len(reduced)}): fairscale's ShardedDataParallel reduces each"
                    " gradient as it is ready, so the ranks' reductions paired unrelated parameters and this step's"
                    " gradients are wrong. Every rank must reach the same parameters in each backward pass: for a"
                    " model whose ranks take different branches (a head per task, experts), use"
                    " CustomDDP(find_unused_parameters=True), or let every rank reach every branch (a zero-weighted"
                    " loss term)."
                )

        def disarm(self) -> None:
            """Arm nothing until the strategy's next backward pass: forward arms every parameter, and a backward
            pass the strategy does not run would reduce those its own passes did not reach, with no wait for the
            reduction (a crash in SDP's cleanup at the next step, or gradients reduced that should stay local).
            The strategy's next backward pass arms them again at its first gradient."""
            self._grad_to_be_reduced = [False for _ in self._trainable_params]
            self._backward_done = True

    ShardedDataParallel.__module__, ShardedDataParallel.__qualname__ = __name__, "ShardedDataParallel"
    return ShardedDataParallel


@functools.lru_cache(maxsize=8)
def _parameter_weights(count: int) -> torch.Tensor:
    """A pseudo-random weight below 2**40 per parameter index, the same on every rank: sums over different sets
    of indices differ but by chance (about one in 2**40), and sums of up to 2**20 of them stay below 2**62."""
    return torch.from_numpy((splitmix64(np.arange(count, dtype=np.uint64)) >> np.uint64(24)).astype(np.int64))


# ---------------------------------------------------------------------------------------------- precision
def rank_synchronised_scaler(
    scaler: Optional[torch.amp.GradScaler], device: str, group: Optional[Any] = None
) -> torch.amp.GradScaler:
    """A ``ShardedGradScaler`` with ``scaler``'s settings (a ShardedGradScaler, or one disabled for ``device``, is
    returned as is: ``GradScaler(device, enabled=False)`` means no loss scaling, and stays so).

    A disabled scaler for another device type (a CUDA one on a CPU machine, which Lightning 2.2 makes for
    "16-mixed" and which disables itself) is replaced by a default ShardedGradScaler, with a message: torch keeps
    no mark of whether it was disabled on purpose.

    With gradients sharded, each rank checks only its own shard for inf/NaN. A plain GradScaler then lets one
    rank skip ``optimizer.step()`` while the others step and broadcast their shards: ranks diverge or hang.
    torch's ShardedGradScaler all-reduces the found-inf flag first, so all skip together (fairscale's own
    scaler is CUDA-only and deprecated).
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if isinstance(scaler, ShardedGradScaler):
        return scaler
    # A scaler for another device type disabled itself (Lightning 2.2 makes a CUDA one for "16-mixed" on CPU): a
    # default ShardedGradScaler stands in. One disabled for this device was the user's choice: no scaling, so
    # nothing for the ranks to agree on.
    if scaler is not None and not scaler.is_enabled():
        scaler_device, device_type = getattr(scaler, "_device", "cuda"), torch.device(device).type
        if scaler_device == device_type:
            return scaler
        rank_zero_info(
            f"The GradScaler for {scaler_device!r} is disabled (it cannot run on {device!r}): training uses a"
            f" ShardedGradScaler on {device!r} with default settings. To train without loss scaling, pass"
            f" MixedPrecision('16-mixed', {device_type!r}, scaler=torch.amp.GradScaler({device_type!r}, enabled=False))"
            " as the Trainer's plugin."
        )
    settings: Dict[str, Any] = {}
    if scaler is not None and scaler.is_enabled():
        settings.update(
            init_scale=scaler.get_scale(),
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
        )
    return ShardedGradScaler(device=device, process_group=group if group is not None else dist.group.WORLD, **settings)


def clip_grad_norm_of_shards(
    optimizer: "OSS", max_norm: float, norm_type: float = 2.0, filter_params_fn: Optional[Any] = None
) -> torch.Tensor:
    """Clip the gradients of a sharded optimizer by their norm over all ranks; return that norm.

    Under ShardedDataParallel each rank holds the gradients of the parameters it owns only. Each rank takes
    the norm of those (the parameters with a gradient now, in the optimizer's current partition), the
    ``norm_type``-th powers are summed (the maxima taken, for ``inf``) over the optimizer's process group, and
    every rank scales its gradients by ``max_norm / (norm + 1e-6)`` where that is below 1: the result is
    ``torch.nn.utils.clip_grad_norm_`` on one process, up to float rounding. fairscale's
    ``OSS.clip_grad_norm`` keeps the parameters that had a gradient at its first call (a parameter unfrozen
    or first used later never counts) and sums over the whole world, not the optimizer's group.

    Call it on every rank of the optimizer's group (it is a collective).

    Args:
        optimizer: a fairscale OSS.
        max_norm: the largest norm the gradients keep.
        norm_type: the p of the p-norm, ``float("inf")`` for the largest absolute value.
        filter_params_fn: as fairscale's: maps this rank's parameters to those that count in the norm.

    Raises:
        ValueError: ``norm_type`` is not positive.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}.")
    sync_partition = getattr(optimizer, "_sync_partition", None)
    if callable(sync_partition):
        sync_partition()
    owned = [
        p for group in optimizer.partition_parameters()[optimizer.rank] for p in group["params"] if p.grad is not None
    ]
    counted = list(filter_params_fn(owned)) if filter_params_fn is not None else owned
    device = owned[0].grad.device if owned else optimizer._default_device
    # The same dtype on every rank (the collective below needs it): from all the optimizer's parameters, not
    # from this rank's gradients (a rank that owns no float64 parameter would reduce in float32).
    every_param = (p for group in optimizer.param_groups for p in group["params"])
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in every_param) else torch.float32
    norms = [torch.linalg.vector_norm(p.grad.detach(), norm_type, dtype=dtype).to(device) for p in counted]
    if norm_type == math.inf:
        local = torch.stack(norms).max() if norms else torch.zeros((), dtype=dtype, device=device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=optimizer.group)
        total = local
    else:
        local = torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros((), dtype=dtype, device=device)
        dist.all_reduce(local, group=optimizer.group)
        total = local.pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in owned:
        grad = cast(torch.Tensor, param.grad)
        grad.detach().mul_(coefficient.to(device=grad.device, dtype=grad.dtype))
    return total


def _clip_through_oss(plugin: Precision) -> None:
    """Make ``plugin.clip_grad_by_norm`` clip OSS optimizers with :func:`clip_grad_norm_of_shards` (idempotent).

    Lightning clips with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters; under
    ShardedDataParallel each rank holds the gradients of its own shard only, so that norm is the shard's
    (2.12 / 1.53 instead of 2.61) and ranks scale differently. An instance attribute shadows the method, so
    this works for every precision plugin class.
    """
    if "clip_grad_by_norm" in vars(plugin):
        return
    oss_class, _ = _fairscale()
    clip_unsharded = plugin.clip_grad_by_norm

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
        raw = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(raw, oss_class):
            clip_grad_norm_of_shards(cast("OSS", raw), clip_val)
        else:
            clip_unsharded(optimizer, clip_val)

    plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------- checkpoints
def require_every_rank(group: Any, timeout: timedelta, group_timeout: Optional[timedelta] = None) -> None:
    """Return once every rank of the Gloo ``group`` has called this; raise a RuntimeError where that fails.

    Consolidating the sharded optimizer state is a collective, so a checkpoint saved on some ranks only
    would hang. ``monitored_barrier`` turns that into an error. Its two sides wait differently (torch's
    Gloo ``monitored_barrier``): rank 0 waits ``timeout`` for the others, then raises naming the ranks that
    did not come (they are not saving); every other rank waits for rank 0's answer as long as ``group``'s
    own timeout (``group_timeout``, only used in the message), then raises; it also raises, at once, when rank
    0 gave up on a third rank that is not saving (it cannot tell which happened). Rank 0 arriving late is not an
    error as long as it is within that timeout: give ``group`` the timeout of the main process group
    (:func:`_renew_save_group` does), so that rank-0-only work before a save (an upload, an evaluation) is
    waited for as any collective would wait for it. After a timeout ``group`` is unusable (and the run is
    over anyway), so give it a group of its own.
    """
    try:
        dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as error:
        if dist.get_rank(group) == 0:
            problem = (
                f"not every rank is saving, or some came more than {timeout} late (rank 0 waited {timeout} for"
                f" them): {error}."
            )
        else:
            waited = f"{group_timeout}" if group_timeout is not None else "the process group's timeout"
            others = ", or another rank is not saving" if dist.get_world_size(group) > 2 else ""
            problem = (
                "rank 0 did not confirm that every rank is saving: either rank 0 is not saving or is later than"
                f" {waited} (it may lag the other ranks by at most the process group's timeout), or this rank came"
                f" more than rank 0's save_timeout after it{others} (if rank 0 is saving, its error names the ranks it"
                f" did not see): {error}."
            )
        raise RuntimeError(
            f"CustomDDPSharded: a checkpoint gathers the sharded optimizer state from every rank, but {problem} Call"
            " trainer.save_checkpoint() on every rank (only rank 0 writes the file), not under"
            " `if trainer.is_global_zero:`; ModelCheckpoint does this already."
        ) from error


#: The checkpoint guard's Gloo group ("group"), the default process group it was made in ("world") and the
#: group's timeout ("timeout").
_save_guard: Dict[str, Any] = {}


def _renew_save_group(timeout: timedelta) -> Any:
    """A new Gloo group over the whole world for :func:`require_every_rank`; the previous one is destroyed.

    Each strategy setup (every fit, validate, test) calls this on every rank, so a group left unusable by a
    timed-out guard is not used again, and one such group exists per process, whichever Trainer made it. It
    is not destroyed at teardown (``trainer.save_checkpoint`` after ``fit`` is guarded too), only at exit. Its
    ``timeout`` is how long ranks other than 0 wait for rank 0 in the guard: the main process group's timeout,
    so that a late rank 0 is waited for as long as any collective would wait for it.
    """
    if _save_guard.get("world") is dist.group.WORLD:  # else it went with its default group
        dist.destroy_process_group(_save_guard["group"])
    group = dist.new_group(backend="gloo", timeout=timeout)
    _save_guard.update(world=dist.group.WORLD, group=group, timeout=timeout)
    return group


def _scales_gradients(plugin: Precision) -> TypeGuard[MixedPrecision]:
    """Whether the precision plugin scales gradients ("16-mixed"), which this strategy does with a ShardedGradScaler."""
    return isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed"


def _current_save_group() -> Optional[Any]:
    """The guard's group, if it belongs to the current default process group."""
    if dist.is_initialized() and _save_guard.get("world") is dist.group.WORLD:
        return _save_guard["group"]
    return None


# ---------------------------------------------------------------------------------------------- strategy
class CustomDDPSharded(CustomDDP):
    """CustomDDP that shards optimizer state and gradients with fairscale (OSS + ShardedDataParallel).

    Each rank keeps the optimizer state, and after the backward pass the gradients, of its own share of the
    parameters only: Adam's per-rank state halves on 2 ranks. Training is otherwise the same as CustomDDP's,
    batch for batch (same samplers, same dealing, same results up to float rounding of clipping norms).

    What it does, and why (each is a silent error in a straight port of Lightning 1.x's ``ddp_sharded``):

    - optimizers from ``configure_optimizers`` are rebuilt as :class:`fairscale.optim.OSS` of the same class,
      parameter groups and defaults (LR schedulers follow, those nested in SequentialLR and ChainedScheduler
      too), partitioned largest-first for balanced shards; an OSS you build yourself is used as it is;
    - groups added with ``add_param_group`` (Lightning's ``BaseFinetuning``), or restored on resume by
      assigning ``param_groups`` (``BaseFinetuning`` again), leave earlier parameters on their rank, the shard
      optimizers step the new ones, and SDP reduces their gradients from the next training step;
    - the model is wrapped in ``ShardedDataParallel`` by :meth:`configure_ddp` after the optimizers exist
      (SDP needs them; Lightning 2.x builds optimizers after wrapping), in a subclass that reduces the
      gradients of every backward pass the strategy runs (``manual_backward``, automatic optimization) and no
      other: SDP itself reduces only the first after each forward, so with manual
      optimization and two backward passes per step the second optimizer stepped on unreduced gradients;
    - every training step runs with the wrapper in train mode, and validation steps bypass the wrapper;
    - gradient accumulation skips synchronisation with SDP's ``no_sync()`` (inherited from CustomDDP);
    - reduce buckets are off (``reduce_buffer_size=0``): Lightning zeroes gradients with ``set_to_none``, which
      detaches them from SDP's buckets and corrupts gradients from the second step; buckets also keep
      unsharded gradient buffers on every rank;
    - norm clipping goes through ``clip_grad_norm_of_shards`` in every precision (the norm over all ranks'
      shards), and ``"16-mixed"`` uses torch's ``ShardedGradScaler`` (found-inf agreed across ranks);
    - checkpoints hold the optimizer state consolidated on rank 0, in the plain optimizer's format, so they
      load into CustomDDP and back; rank 0 drops its consolidated copy once the checkpoint has it.

    Saving a checkpoint gathers every rank's shard: ``trainer.save_checkpoint`` must run on every rank (it
    writes from rank 0 only), as ModelCheckpoint does. Called on some ranks only (e.g. under
    ``if trainer.is_global_zero:``), the gather would hang; instead every rank that is saving raises a
    RuntimeError: rank 0 after ``save_timeout``, naming the ranks that are not saving; any other rank when
    rank 0 raises, or after the process group's ``timeout`` if rank 0 does not come. Rank 0 may therefore come
    late to a save that every rank makes (rank-0-only work before it), by up to the process group's
    ``timeout``, not more.

    Args:
        save_timeout: how long rank 0, saving a checkpoint, waits for the other ranks before raising that
            they are not saving. The other ranks wait for rank 0 as long as the process group's ``timeout``
            (or ``save_timeout``, if that is longer): the timeout of the Gloo group made for this check.
        **kwargs: everything :class:`~lightning_ddp_ext.CustomDDP` accepts, and ShardedDataParallel's
            ``broadcast_buffers``, ``sync_models_at_startup``, ``auto_refresh_trainable``, ``reduce_fp16`` and
            ``warn_on_trainable_params_changed``. torch DDP options (``find_unused_parameters``,
            ``static_graph``, ``ddp_comm_hook``, ...) raise a ValueError.

    Raises:
        ImportError: fairscale is not installed.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_custom_sampler_sharded_spawn")
        >>> type(trainer.strategy).__name__
        'CustomDDPSharded'
    """

    strategy_name = "ddp_custom_sampler_sharded"
    registry_entries: tuple[tuple[str, Dict[str, Any]], ...] = (
        ("ddp_custom_sampler_sharded", {"start_method": "popen"}),
        ("ddp_custom_sampler_sharded_spawn", {"start_method": "spawn"}),
    )

    def __init__(self, *, save_timeout: timedelta = timedelta(minutes=2), **kwargs: Any) -> None:
        _fairscale()  # fail here, with the install hint, rather than at the first step
        ddp_only = sorted(name for name in _DDP_ONLY_STRATEGY_ARGUMENTS if kwargs.get(name) is not None)
        if ddp_only:
            raise ValueError(
                f"CustomDDPSharded does not take {', '.join(ddp_only)}: they configure torch's DistributedDataParallel,"
                " and this strategy wraps the model in fairscale's ShardedDataParallel. Remove them, or use CustomDDP."
            )
        super().__init__(**kwargs)
        accepted = _wrapper_options()
        unknown = sorted(set(self.ddp_kwargs) - set(accepted))
        if unknown:
            raise ValueError(
                f"CustomDDPSharded does not take {', '.join(unknown)}: ShardedDataParallel accepts only"
                f" {', '.join(name for name in accepted if name != 'reduce_buffer_size')}. Remove the others"
                " (find_unused_parameters, static_graph, ... are torch DistributedDataParallel options)."
            )
        if self.ddp_kwargs.get("reduce_buffer_size", 0) != 0:
            raise ValueError(
                "CustomDDPSharded runs ShardedDataParallel without reduce buckets: Lightning zeroes gradients with"
                " set_to_none, which detaches them from the buckets and corrupts gradients from the second step,"
                " and buckets keep unsharded gradient buffers on every rank. Remove reduce_buffer_size."
            )
        self.save_timeout = save_timeout
        self._wrap_pending = False

    # ------------------------------------------------------------------ process group
    @override
    def setup_distributed(self) -> None:
        # A spawned rank unpickles this strategy without importing fairscale or torch's ShardedGradScaler.
        # Imported once the default group exists, their functions whose default argument is `dist.group.WORLD`
        # (fairscale OSS's broadcast_object, ShardedGradScaler.__init__) would hold that group for the life of
        # the process, past CustomDDP's exit handler, and its Gloo threads into interpreter finalisation (see
        # _exit.destroy_process_group).
        _fairscale()
        if _scales_gradients(self.precision_plugin):
            importlib.import_module("torch.distributed.fsdp.sharded_grad_scaler")
        super().setup_distributed()
        # A Gloo group only for the checkpoint guard: monitored_barrier needs Gloo, and a timed-out guard
        # leaves its group unusable, which must not be the group training runs on. Ranks other than 0 wait
        # for rank 0 in the guard as long as this group's timeout: the main group's, so that a rank 0 that is
        # late (rank-0-only work before a save) is waited for as in any collective; never less than
        # save_timeout, so that rank 0 reports ranks that are not saving before the others give up on it.
        main_timeout = _compat.process_group_timeout(self) or default_pg_timeout
        _renew_save_group(max(main_timeout, self.save_timeout))

    @override
    def _release_process_groups(self) -> None:
        """At exit, besides what CustomDDP lets go of: destroy the checkpoint guard's group and drop this module's
        references to it and to the default group."""
        super()._release_process_groups()
        group = _current_save_group()
        if group is not None:
            dist.destroy_process_group(group)
        _save_guard.clear()

    # ------------------------------------------------------------------ set-up: optimizers first, then the wrapper
    @override
    def setup(self, trainer: Trainer) -> None:
        plugin = self.precision_plugin
        _clip_through_oss(plugin)
        if _scales_gradients(plugin):
            scaler = rank_synchronised_scaler(plugin.scaler, plugin.device, self.data_parallel_group)
            if scaler is not plugin.scaler:
                rank_zero_info(f"{type(self).__name__}: gradient scaling with ShardedGradScaler (found-inf agreed).")
                plugin.scaler = scaler
        self.precision_plugin = plugin  # the getter builds a new Precision() when none was set
        self._wrap_pending = False
        super().setup(trainer)

    @override
    def _wrap_lightning_model(self) -> None:
        # Lightning's setup asks for the wrapper before it builds the optimizers; ShardedDataParallel needs
        # the OSS optimizers, so wrapping waits for `setup_optimizers`.
        self._wrap_pending = True

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        """Build the user's optimizers, rebuild them as OSS, point their LR schedulers at them, then wrap the model."""
        super().setup_optimizers(trainer)
        _refuse_shared_parameters(self.optimizers, cast(Module, self.lightning_module))  # set: optimizers come from it
        sharded = [shard_optimizer(optimizer, self.data_parallel_group) for optimizer in self.optimizers]
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]
        for old, new in zip(self.optimizers, sharded):
            if new is not old:
                _point_schedulers_at(schedulers, old, new)
        self.optimizers = sharded
        if self._wrap_pending:
            self._wrap_pending = False
            super()._wrap_lightning_model()

    @override
    def configure_ddp(self, model: Module, device_ids: Optional[List[int]]) -> Module:  # type: ignore[override]
        """Wrap ``model`` in ShardedDataParallel over this strategy's OSS optimizers.

        The wrapper is a subclass of fairscale's that reduces the gradients of every backward pass the strategy
        runs, also of several after one forward (fairscale's reduces only the first). ``device_ids`` is unused:
        SDP works on the device the model is on. Override to change the wrapper's options; ``self.optimizers`` are
        the OSS optimizers at this point. A plain ``ShardedDataParallel`` returned from an override trains correctly
        only with one backward pass per training step.
        """
        oss_class, _ = _fairscale()
        optimizers = [optimizer for optimizer in self.optimizers if isinstance(optimizer, oss_class)]
        if not optimizers:
            raise RuntimeError(f"{type(self).__name__}.configure_ddp needs the OSS optimizers, but there are none.")
        kwargs = {"reduce_buffer_size": 0, **self.ddp_kwargs}
        wrapper = _sharded_data_parallel_class()
        return cast(Module, wrapper(model, optimizers, process_group=self.data_parallel_group, **kwargs))

    # ------------------------------------------------------------------ steps
    def _sharded_wrapper(self) -> Any:
        """The model's ShardedDataParallel wrapper, or None before wrapping."""
        return self.model if isinstance(self.model, _sharded_data_parallel_class()) else None

    @override
    def _synchronises_gradients(self) -> bool:
        """fairscale's wrapper reduces gradients in backward unless inside its ``no_sync``."""
        wrapper = self._sharded_wrapper()
        return self.world_size > 1 and wrapper is not None and not wrapper._should_accumulate_grads

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Lightning's backward, with the wrapper reducing this backward pass also when it is not the first after
        a forward (see the wrapper's ``reduce_every_backward``)."""
        wrapper = self._sharded_wrapper()
        if wrapper is not None:
            wrapper.reduce_every_backward = True
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            if wrapper is not None:
                wrapper.reduce_every_backward = False
                wrapper.disarm()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # Lightning's validation loop calls `trainer.model.eval()`, the wrapper included, but restores the modes
        # of the LightningModule's own modules only. In eval mode SDP drops its gradient hooks and stops
        # reducing, silently. Only the wrapper's own flag is set: the LightningModule's modes are left as they are.
        if self.model is not None and self.model is not self.lightning_module:
            self.model.training = True
            _reduce_added_parameters(self.model)
        try:
            return super().training_step(*args, **kwargs)
        finally:  # a manual-optimization step that skipped its backward leaves the forward's arming behind
            if isinstance(self.model, _sharded_data_parallel_class()):
                cast(Any, self.model).disarm()

    @override
    def on_validation_start(self) -> None:
        """Give every rank rank 0's buffers (BatchNorm statistics, counters) before a validation run, once.

        ``validation_step`` bypasses the wrapper (see there), whose forward is what broadcasts them in training,
        so without this each rank would evaluate with the statistics of its own last training batch, unlike
        ``CustomDDP`` (DDP's forward) and unlike the checkpoint, which saves rank 0's. One collective per
        run, outside the steps, so ``eval_mode="exact"`` is safe.
        """
        if isinstance(self.model, _sharded_data_parallel_class()) and self.ddp_kwargs.get("broadcast_buffers", True):
            cast(Any, self.model).sync_buffers(blocking=True)
        super().on_validation_start()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run ``validation_step`` on the LightningModule itself, not through ShardedDataParallel.

        SDP's forward broadcasts buffers from rank 0 at every call (a collective per step, which hangs with
        ``eval_mode="exact"``, where ranks run different numbers of steps) and, in eval mode, tears down its
        gradient hooks and re-buckets the parameters, under ``inference_mode`` on NCCL as inference tensors.
        Evaluation needs none of SDP, as with torch's DDP under ``no_grad``.
        """
        assert self.lightning_module is not None
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    @override
    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        """The optimizer's full state on rank 0 (``{}`` elsewhere), gathered from every rank's shard.

        Lightning's own ``optimizer_state`` consolidates optimizers that have ``consolidate_state_dict``; this
        first checks that every rank is saving, so a save on rank 0 alone raises instead of hanging. OSS keeps
        the consolidated state (the whole optimizer's, on rank 0) after returning it; it is dropped here, so
        that rank 0 holds it only until the checkpoint is written.
        """
        oss_class, _ = _fairscale()
        raw = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if not isinstance(raw, oss_class):
            return super().optimizer_state(optimizer)
        save_group = _current_save_group()
        if save_group is not None:
            require_every_rank(save_group, self.save_timeout, _save_guard.get("timeout"))
        try:
            return super().optimizer_state(optimizer)
        finally:
            cast(Any, raw)._all_states = []
