"""Rebuild a DataLoader so that each rank iterates its own share, keeping the user's sampler whole.

What gets wrapped, by what the loader holds:

* a default ``RandomSampler``/``SequentialSampler`` (under torch's plain ``BatchSampler`` or none):
  torch's ``DistributedSampler`` over the dataset, shuffling when the original did or as ``shuffle`` says
  (with a ``shuffle_window`` or ``even_shares=False``, which DistributedSampler cannot express,
  ``DistributedSamplerWrapper`` over the dataset's positions, shuffled the same way);
* a custom index sampler (under torch's plain ``BatchSampler`` or none): ``DistributedSamplerWrapper``,
  then batched as before;
* any other batch sampler (a ``BatchSampler`` subclass or a class of its own): ``DistributedBatchSamplerWrapper``,
  which deals its batches out whole; so is a ``BatchSampler`` (or subclass) given as ``sampler=`` with
  ``batch_size=None``, whose items are batches.

No Lightning import here: this works with plain ``torch.distributed``.
"""
from __future__ import annotations

import functools
import inspect
import multiprocessing
import sys
import warnings
from typing import Any, Dict, List, Optional, Set, Tuple

import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from lightning_ddp_ext._checks import (
    check_flag,
    check_seed,
    check_shuffle_window,
    fewer_items_than_ranks,
    length_of,
    nothing_to_deal,
    resolve_world,
)
from lightning_ddp_ext.samplers import DistributedBatchSamplerWrapper, DistributedSamplerWrapper

__all__ = ["patch_dataloader_to_ddp", "is_sharded", "WRAPPER_OPTIONS"]

#: Keyword options of the wrappers that ``patch_dataloader_to_ddp`` accepts.
WRAPPER_OPTIONS = ("shuffle", "seed", "pad", "shuffle_window", "even_shares")

# DataLoader arguments that describe how indices are drawn: these are what we replace. Every other
# argument of DataLoader's signature (read at call time, so new torch arguments carry over) is copied.
_SAMPLING_ARGUMENTS = {"self", "dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"}

#: The first release of each affected CPython line that no longer deadlocks a child forked while another
#: thread of the parent starts or ends (gh-112275; 3.12 and later never did).
_FORK_DEADLOCK_FIXED_IN = {(3, 9): 20, (3, 10): 15, (3, 11): 10}
_PYTHON = (sys.version_info.major, sys.version_info.minor, sys.version_info.micro)

_OWNER = "patch_dataloader_to_ddp"

_warned: set[str] = set()


def _warn_once(message: str, stacklevel: int = 4) -> None:
    """Warn with ``message`` once per process; a warning turned into an error (``-W error``) is not counted.

    ``stacklevel`` counts from here: the default points at the caller of ``patch_dataloader_to_ddp`` for a
    warning given in ``_patch``."""
    if message not in _warned:
        warnings.warn(message, UserWarning, stacklevel=stacklevel)
        _warned.add(message)


def _worker_start_method(loader: DataLoader) -> str:
    """How the loader starts its worker processes: its ``multiprocessing_context``, else the default one."""
    context = loader.multiprocessing_context
    if context is not None:
        return str(context.get_start_method())
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


def _fork_deadlock_warning(loader: DataLoader, version: Tuple[int, int, int] = _PYTHON) -> Optional[str]:
    """A warning when the loader forks its workers on a Python that can deadlock a forked child, else None.

    A rank has threads that start and end (every finished DataLoader iterator ends its queue-feeder threads,
    just before the next epoch forks new workers). On CPython before 3.11.10 (3.10.15, 3.9.20) a child forked
    at such a moment can deadlock before it runs any code: its rank waits for it forever, and the other ranks
    fail at the process-group timeout with an error that does not name the cause.
    """
    fixed = _FORK_DEADLOCK_FIXED_IN.get((version[0], version[1]))
    if loader.num_workers == 0 or fixed is None or version[2] >= fixed or _worker_start_method(loader) != "fork":
        return None
    release = ".".join(map(str, version))
    return (
        f"DataLoader workers are forked, and Python {release} can deadlock a forked worker before it starts"
        f" (CPython issue gh-112275, fixed in {version[0]}.{version[1]}.{fixed}): the rank then waits for it"
        " forever and the other ranks fail at the process-group timeout. Each start of the workers risks it (every"
        " epoch, unless persistent_workers=True). Upgrade Python, or start the workers without forking the rank:"
        " DataLoader(..., multiprocessing_context='spawn', persistent_workers=True)."
    )


def is_sharded(loader: DataLoader) -> bool:
    """Whether the loader already gives each rank its own share (a distributed sampler or one of ours), also
    when the distributed sampler sits inside the batch sampler, or inside a batch sampler given as ``sampler=``
    (``batch_size=None``)."""
    return _sharding_sampler(loader) is not None


def _sharding_sampler(loader: DataLoader) -> Any:
    """The sampler that gives each rank of ``loader`` its share (see :func:`is_sharded`), or None."""
    sharded = (DistributedSampler, DistributedSamplerWrapper, DistributedBatchSamplerWrapper)
    candidates = (
        loader.sampler,
        loader.batch_sampler,
        getattr(loader.batch_sampler, "sampler", None),
        getattr(loader.sampler, "sampler", None),
    )
    return next((candidate for candidate in candidates if isinstance(candidate, sharded)), None)


_TORCHDATA_SAMPLERS = "torchdata.stateful_dataloader.sampler"


def _is_plain(item: Any, torch_class: type) -> bool:
    """Whether ``item`` is exactly torch's ``torch_class`` (``BatchSampler``, ``RandomSampler``) or torchdata's
    stateful copy of it, which a ``StatefulDataLoader`` makes in its place and which draws the same way. A
    subclass of either may draw otherwise: not plain. (torchdata is only looked up where it is imported.)"""
    if type(item) is torch_class:
        return True
    stateful = sys.modules.get(_TORCHDATA_SAMPLERS)
    return stateful is not None and type(item) is getattr(stateful, torch_class.__name__, None)


def _is_random_permutation(sampler: Any) -> bool:
    """A default ``RandomSampler`` (torch's or torchdata's), whatever it draws from."""
    return _is_plain(sampler, RandomSampler)


def _is_default_sampler(sampler: Sampler[Any], dataset: Any) -> bool:
    """Samplers that DistributedSampler reproduces exactly: sequential, or a plain permutation, over the
    loader's own dataset (one over another data source draws other indices: it is wrapped like a custom one)."""
    if type(sampler) is SequentialSampler:
        return _is_own_data(sampler.data_source, dataset)
    if _is_random_permutation(sampler):
        permutation: Any = sampler
        plain = not permutation.replacement and permutation.num_samples == len(dataset)
        return _is_own_data(permutation.data_source, dataset) and plain
    return False


def _dataset_length(dataset: Any) -> int:
    """``len(dataset)`` of a loader with a default sampler, or a TypeError saying what to change."""
    name = type(dataset).__name__
    return length_of(
        dataset,
        f"{_OWNER}: len() of the loader's dataset ({name})",
        f"Its default sampler's indices are dealt out among the ranks, so every rank must know how many there are:"
        f" give {name} a __len__ that returns its number of samples (or make it an IterableDataset that shards"
        " itself; such a loader is returned unchanged).",
    )


def _is_own_data(data_source: Any, dataset: Any) -> bool:
    """Whether a default sampler draws from the loader's dataset. DataLoader wraps a ``MapDataPipe`` for pickling
    (``loader.dataset._datapipe`` is the pipe) but gives its default sampler the pipe itself."""
    return data_source is dataset or data_source is getattr(dataset, "_datapipe", dataset)


def _check_options(options: Dict[str, Any]) -> None:
    """Refuse options of the wrong type with the wrappers' errors, whichever sampler they end up with (torch's
    DistributedSampler would take ``shuffle="no"`` as true, and a float seed only fails at the first epoch)."""
    for flag in ("pad", "even_shares") + (("shuffle",) if options.get("shuffle") is not None else ()):
        if flag in options:
            check_flag(options[flag], flag, _OWNER)
    if "seed" in options:
        check_seed(options["seed"], _OWNER)
    check_shuffle_window(options.get("shuffle_window"), _OWNER)


def _plainly_batched_sampler(loader: DataLoader) -> Optional[Sampler[Any]]:
    """The index sampler of a loader batched by torch's plain ``BatchSampler`` (or torchdata's copy of it, or not
    batched at all); None when a batch sampler of another kind makes the batches.

    With ``DataLoader(batch_sampler=BatchSampler(...))``, ``loader.sampler`` is a default SequentialSampler: the
    batch sampler's own sampler is the one that draws."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        return loader.sampler  # type: ignore[return-value]
    if _is_plain(batch_sampler, BatchSampler):
        return batch_sampler.sampler  # type: ignore[attr-defined,no-any-return]
    return None


def uses_default_sampler(loader: DataLoader) -> bool:
    """Whether ``loader`` draws with a default sampler (sequential, or a plain permutation, of its own dataset,
    batched by torch's plain ``BatchSampler`` or not at all): the loaders :func:`patch_dataloader_to_ddp` deals
    like torch's ``DistributedSampler``."""
    sampler = _plainly_batched_sampler(loader)
    return sampler is not None and _is_default_sampler(sampler, loader.dataset)


def _deal_default_sampler(sampler: Sampler[Any], dataset: Any, wrapper_kwargs: Dict[str, Any]) -> Sampler[Any]:
    """The sampler that deals a default sampler's dataset out: torch's ``DistributedSampler`` where it can.

    ``shuffle`` True/False wins over the sampler's type (None or absent: shuffled iff a RandomSampler). Windows
    and uneven shares need our wrapper over the dataset's positions. An empty dataset is refused whatever
    ``pad`` is: padding nothing would silently give every rank 0 batches.
    """
    world, pad = wrapper_kwargs["num_replicas"], wrapper_kwargs.get("pad", True)
    size = _dataset_length(dataset)
    if size == 0:
        raise nothing_to_deal(type(dataset).__name__, world)
    shuffle = wrapper_kwargs.get("shuffle")
    shuffle = _is_random_permutation(sampler) if shuffle is None else bool(shuffle)
    if wrapper_kwargs.get("shuffle_window") is not None or not wrapper_kwargs.get("even_shares", True):
        return DistributedSamplerWrapper(SequentialSampler(dataset), **dict(wrapper_kwargs, shuffle=shuffle))
    if not pad and size < world:
        raise fewer_items_than_ranks(f"{type(dataset).__name__} has {size} sample(s)", world)
    return DistributedSampler(
        dataset,
        num_replicas=world,
        rank=wrapper_kwargs["rank"],
        shuffle=shuffle,
        seed=int(wrapper_kwargs.get("seed", 0)),  # checked to be an integer (a numpy one too) by _check_options
        drop_last=not pad,
    )


def _carried_arguments(loader: DataLoader) -> Dict[str, Any]:
    """``loader``'s DataLoader arguments but the sampling ones. Without workers (``num_workers`` may be set to 0
    after construction, to debug in one process) the settings of workers are left at DataLoader's defaults:
    they would do nothing, and DataLoader refuses them beside ``num_workers=0``."""
    carried: Dict[str, Any] = {}
    for name in inspect.signature(DataLoader.__init__).parameters:
        if name in _SAMPLING_ARGUMENTS or not hasattr(loader, name):
            continue
        carried[name] = getattr(loader, name)
    if carried.get("num_workers", 0) == 0:
        carried.update((name, value) for name, value in _WORKERS_ONLY.items() if name in carried)
    return carried


#: DataLoader's arguments that need workers (``num_workers > 0``), with the values it takes without them.
_WORKERS_ONLY = {"prefetch_factor": None, "persistent_workers": False, "multiprocessing_context": None}


def patch_dataloader_to_ddp(
    loader: DataLoader,
    num_replicas: Optional[int] = None,
    rank: Optional[int] = None,
    **options: Any,
) -> DataLoader:
    """Return a new DataLoader over the same dataset that yields only this rank's share.

    Every DataLoader argument other than the sampling ones is carried over. The user's sampler or batch
    sampler is wrapped, never rebuilt, so batches a batch sampler builds itself reach the model unchanged.
    A DataLoader subclass (torchdata's ``StatefulDataLoader``, one with an ``__iter__`` of its own) is built
    again as its own class when every argument of its ``__init__`` is one of DataLoader's, an attribute of
    the same name, or left at its default, and the copy holds the sharded sampler and otherwise the same
    attributes as the original; else the new loader is a plain ``DataLoader`` and a warning says what was
    lost and what to change.

    Once patched, a default sampler's order comes from ``seed + epoch`` (the same on every rank), no longer
    from the loader's ``generator=`` or the ``RandomSampler``'s own. Before each epoch call ``set_epoch(epoch)`` on
    ``loader.batch_sampler.sampler``, or on ``loader.sampler`` when ``loader.batch_sampler`` is None
    (``batch_size=None``): in every loader this shards that is the new sampler, or for a custom batch sampler
    a relay to its wrapper (where Lightning's loop calls it too).

    A custom sampler is run whole on every rank, each keeping every W-th item, so it must draw the same sequence
    on every rank: seed it identically (an unseeded ``WeightedRandomSampler`` or ``SubsetRandomSampler`` draws
    from each process's own seed, and the shares overlap). ``CustomDDP`` checks that itself; in plain PyTorch
    pass the wrapper's ``head_digest`` to :func:`~lightning_ddp_ext.consistency.verify_same_sequence` once the
    first batch is drawn.

    Args:
        loader: the single-process DataLoader.
        num_replicas: number of ranks; defaults to the default process group's world size.
        rank: this rank; defaults to the rank in the default process group.
        **options: ``shuffle``, ``seed``, ``pad``, ``shuffle_window`` and ``even_shares`` for the wrappers (see
            :class:`~lightning_ddp_ext.samplers.DistributedBatchSamplerWrapper`); ``shuffle=None`` is False there.
            All five apply to a default sampler too: ``shuffle=True``/``False`` wins over what its type implies
            (None or absent: shuffled iff it was a ``RandomSampler``), ``seed`` seeds that shuffle, ``pad=False``
            drops the incomplete round; a ``shuffle_window`` (not None) or ``even_shares=False`` deals the
            dataset's positions with ``DistributedSamplerWrapper`` instead of ``DistributedSampler``, which can
            neither shuffle within windows nor leave shares uneven.

    Returns:
        The new loader; the loader itself when there is nothing to shard: a loader that is already sharded
        (silently), an IterableDataset or no process group and no explicit ``num_replicas``/``rank`` (with a
        warning). Explicit ``num_replicas``/``rank`` are validated in every case.

    Raises:
        ValueError: ``num_replicas``/``rank`` out of range or not integers; an empty sampler or dataset;
            ``pad=False`` with fewer items than ranks; ``drop_last`` batches larger than a rank's share; an
            option of the wrong type.
        TypeError: an unknown option; not a DataLoader; ``dataset=None``; a sampler without ``__len__``.
        RuntimeError: no process group, and only one of ``num_replicas``/``rank`` given.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(range(10), batch_size=2)
        >>> [batch.tolist() for batch in patch_dataloader_to_ddp(loader, num_replicas=2, rank=1)]
        [[1, 3], [5, 7], [9]]
    """
    return _patch(loader, num_replicas, rank, options, keep_class=True)


def _patch(
    loader: DataLoader,
    num_replicas: Optional[int],
    rank: Optional[int],
    options: Dict[str, Any],
    keep_class: bool,
    owner: str = _OWNER,
) -> DataLoader:
    """:func:`patch_dataloader_to_ddp`; ``keep_class=False`` returns a plain DataLoader for a subclass too, for a
    caller that rebuilds the class itself (``CustomDDP``, from Lightning's record of the loader's arguments).
    ``owner`` names that caller in the warnings: the user of a strategy never called this function."""
    unknown = set(options) - set(WRAPPER_OPTIONS)
    if unknown:
        raise TypeError(
            f"patch_dataloader_to_ddp got unknown option(s) {sorted(unknown)}; the accepted ones are"
            f" {list(WRAPPER_OPTIONS)}."
        )
    _check_options(options)
    if not isinstance(loader, DataLoader):
        raise TypeError(f"patch_dataloader_to_ddp expects a torch DataLoader, got {type(loader).__name__}.")
    if loader.dataset is None:
        raise TypeError(
            "patch_dataloader_to_ddp got a DataLoader with dataset=None: there is nothing to index, so no share can be"
            " dealt to a rank. Pass the dataset to the DataLoader (DataLoader(dataset, batch_sampler=...))."
        )
    # Explicit values are checked before any early return: a wrong rank must not pass just because the
    # loader needed no sharding.
    given = num_replicas is not None or rank is not None
    resolved = resolve_world(num_replicas, rank, _OWNER) if given else None
    if isinstance(loader.dataset, IterableDataset):
        unchanged = "the loader is returned unchanged" if owner == _OWNER else "every rank iterates the loader whole"
        _warn_once(
            f"{owner}: {type(loader.dataset).__name__} is an IterableDataset; {unchanged}. An iterable dataset must"
            " shard itself (read torch.distributed.get_rank() and torch.utils.data.get_worker_info() in its"
            " __iter__)."
        )
        return loader
    sharding = _sharding_sampler(loader)
    if resolved is None and sharding is None and not (dist.is_available() and dist.is_initialized()):
        _warn_once(
            f"{owner}: no process group is initialised and no num_replicas/rank were given, so the"
            " loader is returned unchanged (single-process run). Initialise torch.distributed first, or pass"
            " num_replicas and rank."
        )
        return loader
    if sharding is not None:  # already dealt: returned as it is, also without a process group
        dealt_for = (sharding.num_replicas, sharding.rank)
        if resolved is not None and dealt_for != resolved:
            raise ValueError(
                f"{owner}: the loader is already sharded by its {type(sharding).__name__} for rank {dealt_for[1]} of"
                f" {dealt_for[0]}, not for the rank {resolved[1]} of {resolved[0]} given, and is never dealt again."
                " Build the loader without it and let patch_dataloader_to_ddp deal it, or give the sampler this"
                " run's num_replicas and rank."
            )
        return loader
    world, own_rank = resolved or resolve_world(None, None, _OWNER)
    fork_risk = _fork_deadlock_warning(loader)
    if fork_risk is not None and world > 1:
        _warn_once(f"{owner}: {fork_risk}")
    wrapper_kwargs = dict(options, num_replicas=world, rank=own_rank)
    if wrapper_kwargs.get("shuffle", False) is None:  # "as the loader does": the wrappers' default, no permutation
        del wrapper_kwargs["shuffle"]
    carried = _carried_arguments(loader)
    dataset = loader.dataset
    batch_sampler = loader.batch_sampler
    sampler = _plainly_batched_sampler(loader)
    build = functools.partial(_build, loader, carried, keep_class)
    if sampler is None:
        new_batch_sampler = DistributedBatchSamplerWrapper(batch_sampler, **wrapper_kwargs)  # type: ignore[arg-type]
        return build(batch_sampler=new_batch_sampler, batch_size=1, drop_last=False)
    if batch_sampler is None and isinstance(sampler, BatchSampler):
        # DataLoader(sampler=BatchSampler(...), batch_size=None): the dataset fetches a whole batch per key, so
        # the sampler's items are batches, dealt whole like a batch sampler's.
        batches = DistributedBatchSamplerWrapper(sampler, **wrapper_kwargs)
        return build(batch_size=None, sampler=batches)

    # The batch sampler's own size and drop_last: with DataLoader(batch_sampler=BatchSampler(...)),
    # loader.batch_size is None.
    new_sampler: Sampler[Any]
    if _is_default_sampler(sampler, dataset):
        new_sampler = _deal_default_sampler(sampler, dataset, wrapper_kwargs)
    else:
        new_sampler = DistributedSamplerWrapper(sampler, **wrapper_kwargs)
    if batch_sampler is None:  # automatic batching off: the sampler's indices are the items
        return build(batch_size=None, sampler=new_sampler)
    batch_size, drop_last = batch_sampler.batch_size, batch_sampler.drop_last  # type: ignore[attr-defined]
    if drop_last:
        _refuse_shares_without_a_batch(sampler, new_sampler, batch_size, world, wrapper_kwargs.get("pad", True))
    return build(batch_size=batch_size, drop_last=drop_last, sampler=new_sampler)


def _build(loader: DataLoader, carried: Dict[str, Any], keep_class: bool, **sampling: Any) -> DataLoader:
    """The new loader over ``loader``'s dataset with ``sampling`` (the sharded sampler or batch sampler and how to
    batch) and the ``carried`` arguments: ``loader``'s own class where it can be built again (see
    :func:`_same_class`), else a plain DataLoader."""
    if keep_class and type(loader) is not DataLoader:
        rebuilt, why_not = _same_class(loader, carried, sampling)
        if rebuilt is not None:
            return rebuilt
        cls = type(loader).__name__
        _warn_once(
            f"{_OWNER}: {cls} is a DataLoader subclass but could not be built again with the sharded sampler"
            f" ({why_not}), so this rank's share is loaded by a plain DataLoader: what {cls} adds (its __iter__, its"
            f" state_dict, its own arguments) is lost. Let {cls}.__init__ take DataLoader's arguments and pass them"
            " on, keeping any argument of its own as an attribute of the same name (and load a state, such as a"
            " StatefulDataLoader's, into the patched loader, not before patching); or build the loader yourself"
            " around DistributedBatchSamplerWrapper / DistributedSamplerWrapper.",
            stacklevel=5,  # _build is called from _patch
        )
    plain = {name: value for name, value in sampling.items() if not (name == "batch_sampler" and value is None)}
    if "batch_sampler" in plain:
        plain = {"batch_sampler": plain["batch_sampler"]}  # DataLoader refuses batch_size/drop_last beside it
    return DataLoader(loader.dataset, **plain, **carried)


def _same_class(
    loader: DataLoader, carried: Dict[str, Any], sampling: Dict[str, Any]
) -> Tuple[Optional[DataLoader], str]:
    """``loader``'s class built again with ``sampling``, or None and why not.

    Each argument of its ``__init__`` is taken from ``sampling`` and ``carried`` (DataLoader's own), else from an
    attribute of the same name; one without either keeps its default, and a required one fails. Its ``__init__``
    runs again (as in Lightning's rebuild of loaders). The result is kept only if it holds the sharded sampler
    and, but for the sampling, the same attributes as ``loader``: an argument the class stores under another
    name, transforms, or never sees (set on the loader afterwards) would otherwise change silently.
    """
    cls = type(loader)
    sampling = {"sampler": None, "batch_sampler": None, "shuffle": None, **sampling}
    known = {"dataset": loader.dataset, **carried, **sampling}
    try:
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError) as error:
        return None, f"its __init__ has no signature: {error}"
    positional: List[Any] = []
    keywords: Dict[str, Any] = {}
    bound_by_position: Set[str] = set()
    for parameter in parameters:
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:  # passes DataLoader's arguments on
            unbound = {name: value for name, value in known.items() if name not in bound_by_position}
            keywords.update((name, value) for name, value in unbound.items() if name not in keywords)
            continue
        name = parameter.name
        if name in known:
            value = known[name]
        elif hasattr(loader, name):
            value = getattr(loader, name)
        elif parameter.default is not inspect.Parameter.empty:
            if parameter.kind is not inspect.Parameter.POSITIONAL_ONLY:
                continue
            value = parameter.default
        else:
            return None, f"its argument {name!r} is neither DataLoader's nor kept as an attribute"
        if parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
            positional.append(value)
            bound_by_position.add(name)
        else:
            keywords[name] = value
    needed = [name for name in ("sampler", "batch_sampler") if sampling[name] is not None and name not in keywords]
    if needed:
        return None, f"its __init__ takes no {needed[0]} argument"
    try:
        rebuilt = cls(*positional, **keywords)
    except Exception as error:  # noqa: BLE001 - whatever the class raises: fall back, and say why
        return None, f"{cls.__name__}(...) raised {type(error).__name__}: {error}"
    batched = sampling["batch_sampler"] is not None
    kind = "batch_sampler" if batched else "sampler"
    if getattr(rebuilt, kind) is not sampling[kind]:
        return None, "it replaced the sharded sampler it was given"
    expected = {"batch_size": None if batched else sampling.get("batch_size", 1)}
    expected["drop_last"] = False if batched else sampling.get("drop_last", False)
    if carried.get("num_workers", 0) == 0:  # the settings of workers, left at their defaults (_carried_arguments)
        expected.update(prefetch_factor=None, persistent_workers=False, _DataLoader__multiprocessing_context=None)
    original = {**vars(loader), **expected}
    for name, value in original.items():
        if name in _REBUILT_MAY_DIFFER or name.startswith(_BOOKKEEPING):
            continue
        if not _same_value(vars(rebuilt).get(name, _MISSING), value):
            return None, f"built again, its attribute {name!r} differs from the loader's"
    return rebuilt, ""


#: Attributes of a rebuilt loader that differ from the original's by design: the sharded sampling (``shuffle``
#: where a subclass keeps it: the sharded sampler decides now), and an iterator the original may keep (persistent
#: workers).
_REBUILT_MAY_DIFFER = {"sampler", "batch_sampler", "shuffle", "_iterator"}
#: Names set from outside the class, as frameworks do: Lightning records how a loader made in a ``*_dataloader``
#: hook was constructed under ``__pl_*`` and ``__dataset`` (a class's own ``__name`` is stored as ``_Class__name``).
_BOOKKEEPING = "__"
_MISSING = object()


def _same_value(first: Any, second: Any) -> bool:
    """Whether two attribute values are the same object, or equal values of one type (arrays: only the same)."""
    if first is second:
        return True
    try:
        return type(first) is type(second) and bool(first == second)
    except Exception:  # noqa: BLE001 - an ambiguous comparison (tensors, arrays) means "not known to be equal"
        return False


def _refuse_shares_without_a_batch(
    sampler: Sampler[Any], dealt: Sampler[Any], batch_size: int, world: int, pad: bool
) -> None:
    """Raise, on every rank alike, when ``drop_last`` batching of the dealt shares leaves a rank with no batch
    although the single-process loader had one: that rank would train or evaluate nothing, silently (or, if
    only some ranks are left without, the others would wait for it in their collectives). Also under
    ``CustomDDP``, whose options the message names too."""
    items = len(sampler)  # type: ignore[arg-type]
    uneven = isinstance(dealt, DistributedSamplerWrapper) and not dealt.even_shares
    fewest = items // world if uneven else len(dealt)  # type: ignore[arg-type]
    if fewest >= batch_size or items < batch_size:
        return
    who = f"rank {world - 1}" if uneven else "every rank"
    fixes = ["a smaller batch_size", "drop_last=False", "fewer ranks"]
    if -(-items // world) >= batch_size:  # padded even shares would hold a batch
        if uneven:
            fixes.append("even shares (even_shares=True; with CustomDDP, eval_mode='pad')")
        elif not pad:
            fixes.append("padded shares (pad=True; with CustomDDP, pad_to_world_size=True)")
    raise ValueError(
        f"DataLoader(batch_size={batch_size}, drop_last=True) leaves {who} without a batch: the {items} samples of"
        f" {type(sampler).__name__} dealt among {world} ranks give {who} {fewest}, and drop_last drops an incomplete"
        f" batch (a single process had {items // batch_size}). Use {', '.join(fixes[:-1])} or {fixes[-1]}."
    )
