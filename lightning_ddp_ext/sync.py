"""Merge per-rank results across a ``torch.distributed`` process group, without any training framework.

Under DDP every rank ends an evaluation or prediction loop holding only its share of the outputs. The helpers
here give every rank the whole result. Tensors travel as tensors: every tensor of a call is viewed as raw bytes,
packed into one buffer per rank and exchanged with a padded ``all_gather`` (on Gloo, as concurrent chunks).
That is several times faster than pickling large outputs, works for dtypes gloo cannot reduce (``bool``), and
keeps each result on the device its input came from (CUDA with NCCL). Only non-tensor values go through
``all_gather_object``.

Every decision that could raise (mismatched keys, shapes, dtypes) is taken from data that all ranks have
gathered, so all ranks raise the same error together instead of leaving some of them waiting in a collective.
A rank's own bad input (no dict, a sparse tensor, a value that cannot be pickled) travels with that data too.
"""
from __future__ import annotations

import cmath
import math
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Sized, Tuple, Type, Union

import numpy as np
import torch
import torch.distributed as dist

from lightning_ddp_ext._checks import integer_or_none
from lightning_ddp_ext._pickling import error_message

__all__ = ["sync_dicts", "gather_in_order"]

_ALIGN = 16  # bytes; the largest element size (complex128), so every packed tensor can be viewed in place
_MAX_NAMED = 10  # how many offending keys/indices an error message names
_GLOO_CHUNK_BYTES = 8 << 20  # CPU buffers travel in chunks of this size, several in flight at once

_Path = Tuple[Any, ...]  # the keys leading from the top-level dict to a value
_Meta = Tuple[Tuple[int, ...], torch.dtype]  # (shape, dtype) of one tensor
# Raises if the ranks' schemas cannot be merged: (kinds, metas, slots) per rank, as _check_schemas takes them.
_Check = Callable[[List[Dict[_Path, str]], List[List[_Meta]], List[Dict[_Path, int]]], None]
_INDEX_RULE = "indices must be a 1-D integer tensor or sequence of ints, one per sample (row) of values"


@dataclass(frozen=True)
class _Slot:
    """Stands in for the ``index``-th tensor taken out of a value before it is pickled."""

    index: int


def sync_dicts(d: Dict[Any, Any], world_size: Optional[int] = None, group: Optional[Any] = None) -> Dict[Any, Any]:
    """Give every rank the merge of all ranks' dicts.

    Values under the same key are merged in rank order: tensors are concatenated along dim 0 (0-dim tensors
    count as shape ``(1,)``) and returned on the device the local tensor was on; lists and tuples are
    concatenated (tensors inside them travel as tensors too); nested dicts are merged key by key with the same
    rules; any other value becomes the list of every rank's value. Results carry no autograd history. Keys are
    matched as a dict matches them (``==`` and hash), whatever their repr.

    Args:
        d: This rank's values. Every rank must pass the same keys, at every nesting level.
        world_size: The expected number of ranks; ``1`` skips communication. Checked against ``group``.
        group: The process group to gather over; the default group if ``None``.

    Returns:
        The merged dict, the same on every rank, its keys in rank 0's order (a loop over it that logs each key
        with ``sync_dist=True`` then pairs the same keys on every rank). ``d`` itself when there is no initialised
        process group, a world size of 1, or this rank is not in ``group`` (it takes no part, as in torch's own
        collectives).

    Raises:
        ValueError: If ranks disagree on keys, on the kind of value under a key, or on the trailing shape or
            dtype of a tensor that is to be concatenated, or ``world_size`` is wrong; raised on every rank.
        TypeError: If a rank passes no dict (also without a process group), a sparse tensor, a value that
            cannot be pickled or a ``world_size`` that is no int; raised on every rank, naming the rank.
    """
    ranks, problem = _ranks_to_gather(world_size, group)
    if problem is None and not isinstance(d, dict):  # also without a group, so the mistake shows on one process
        problem = TypeError(f"sync_dicts expects a dict, got {type(d).__name__}; wrap it in one: {{'name': value}}")
    if ranks <= 1:
        if problem is not None:
            raise problem
        return d
    return _exchange(d, ranks, group, problem, _check_schemas, caller="sync_dicts")


def gather_in_order(
    values: Union[torch.Tensor, Sequence[Any]],
    indices: Union[torch.Tensor, Sequence[int]],
    dataset_size: Optional[int] = None,
    group: Optional[Any] = None,
) -> Union[torch.Tensor, List[Any]]:
    """Gather every rank's per-sample values and return them ordered by dataset index.

    Distributed samplers pad the dataset so every rank gets the same number of samples, which makes some
    samples appear twice; this puts the outputs back in dataset order and drops those repeats, checking that a
    repeated sample produced the same value both times. The copy from the lowest rank is kept.

    A padded sample is computed on another rank in a batch of another size, and kernels round differently for
    different batch sizes, so "the same value" allows for rounding: floating-point and complex tensors (and
    numpy arrays and their scalars, such as the elements of a 1-D array) agree when every element is within
    ``sqrt(eps)`` of their dtype times the sample's largest finite magnitude (3.5e-4 for float32) plus the
    smallest normal number, NaN matching NaN. float32 may have been computed in TF32 on a CUDA machine
    (``torch.backends.cudnn.allow_tf32``, on by default, or ``torch.set_float32_matmul_precision("high")``): it
    then gets TF32's ``sqrt(eps)``, 0.031. Integer and bool tensors and other objects, Python floats included,
    must be equal (``==``), and tensors and numpy arrays must have the same dtype and shape.

    Args:
        values: This rank's outputs: a tensor whose first dim runs over samples, or a sequence of per-sample
            objects.
        indices: The dataset index of each of those samples (1-D integer tensor or sequence of ints).
        dataset_size: If given, every index in ``range(dataset_size)`` must be present and no other; the same
            on every rank.
        group: The process group to gather over; the default group if ``None``.

    Returns:
        A tensor (on the device of ``values``) or a list, one entry per distinct index, in index order. Without a
        process group only the local values are ordered and checked.

    Raises:
        ValueError: If ``values`` and ``indices`` differ in length, indices are not 1-D integers (per-batch
            lists included), ranks pass values of different kinds, trailing shapes or dtypes, one index
            carries two different values, or, with ``dataset_size``, an index is missing or out of range, or
            ``dataset_size`` is negative or differs between ranks.
        TypeError: If ``values`` is no sequence (a dict or a set is not one), an index is no number, a value
            cannot be sent, two values of a repeated index cannot be compared, or ``dataset_size`` is no int.
        Either is raised on every rank, naming the rank when only some ranks passed bad input.
    """
    return _gather_in_order(values, indices, dataset_size, group)


def _gather_in_order(
    values: Union[torch.Tensor, Sequence[Any]],
    indices: Union[torch.Tensor, Sequence[int]],
    dataset_size: Optional[int] = None,
    group: Optional[Any] = None,
    problem: Optional[Exception] = None,
) -> Union[torch.Tensor, List[Any]]:
    """:func:`gather_in_order`, raising ``problem`` (a caller's check of this rank's input) on every rank."""
    local: Dict[str, Any] = {}
    try:
        if problem is None:
            size = _checked_dataset_size(dataset_size)
            index = _as_index_tensor(indices)
            local = {"values": _per_sample(values, index.numel()), "indices": index}
            local["dataset_size"] = torch.tensor([-1 if size is None else size])  # compared once gathered
    except Exception as error:  # this rank's alone: it travels to the others with the first exchange
        local, problem = {}, error
    ranks, _ = _ranks_to_gather(None, group)
    if ranks > 1:
        local = _exchange(local, ranks, group, problem, _check_gathered, caller="gather_in_order")
        sizes = [None if size < 0 else size for size in local["dataset_size"].tolist()]
        if len(set(sizes)) > 1:  # every rank holds them all: every rank raises
            raise ValueError(
                f"gather_in_order: dataset_size is {_by_rank(sizes)}; pass the same dataset_size on every rank"
                " (the number of samples of the whole dataset, len(dataset)), or None on every rank"
            )
    elif problem is not None:
        raise problem
    # A rank outside `group` (0 ranks) holds only its own values: no dataset_size to check them against.
    return _dedupe_in_order(local["values"], local["indices"].cpu(), dataset_size if ranks else None)


# --- the exchange ----------------------------------------------------------------------------------------------


def _checked_dataset_size(dataset_size: Optional[int]) -> Optional[int]:
    """``dataset_size`` as an int (None stays None), or the error saying what to pass."""
    if dataset_size is None:
        return None
    size = integer_or_none(dataset_size)
    if size is None:
        raise TypeError(
            f"gather_in_order: dataset_size must be an int (len(dataset)) or None, got {type(dataset_size).__name__}"
        )
    if not 0 <= size < 2**63:
        raise ValueError(f"gather_in_order: dataset_size must be in [0, 2**63) (len(dataset)), got {size}")
    return size


def _ranks_to_gather(world_size: Optional[int], group: Optional[Any]) -> Tuple[int, Optional[Exception]]:
    """How many ranks to gather over (1: nothing to gather; 0: this rank is outside ``group``), and what is wrong
    with ``world_size``, if anything.

    ``world_size=1`` or no initialised process group means 1. A rank outside ``group`` (torch says -1 there) takes
    no part, as in torch's own collectives. A ``world_size`` other than the group's is checked only where there is
    a group to check it against.
    """
    initialized = dist.is_available() and dist.is_initialized()
    ranks = 1 if world_size == 1 or not initialized else max(dist.get_world_size(group), 0)
    if world_size is not None and integer_or_none(world_size) is None:
        kind = type(world_size).__name__
        return max(ranks, 1), TypeError(f"world_size must be an int (the number of ranks) or None, got {kind}")
    if world_size is not None and world_size < 1:
        return max(ranks, 1), ValueError(f"world_size must be at least 1, got {world_size}")
    if initialized and ranks and world_size not in (None, 1, ranks):
        return ranks, ValueError(f"world_size={world_size} but the process group has {ranks} ranks")
    return ranks, None


def _exchange(
    d: Dict[Any, Any],
    ranks: int,
    group: Optional[Any],
    problem: Optional[Exception],
    check: _Check,
    caller: str,
) -> Dict[Any, Any]:
    """The merge of :func:`sync_dicts` over ``ranks`` > 1 ranks; ``problem``: why this rank cannot take part.

    The first exchange carries each rank's problem along with its schema, so one rank's bad input makes every
    rank raise instead of leaving the others waiting in the next collective. Everything this rank sends as an
    object is pickled here first, so a value that cannot be pickled is such a problem too. ``check`` rejects
    schemas that cannot be merged and ``caller`` names the public function in errors, so that each reports
    in the terms of its own arguments.
    """
    leaves: Dict[_Path, Any] = {}
    tensors: List[torch.Tensor] = []
    raws: List[torch.Tensor] = []
    header, skeletons = b"", b""
    if problem is None:
        try:
            leaves = _flatten(d)
            tensors = [v for v in leaves.values() if isinstance(v, torch.Tensor)]  # tensor leaves first
            header, skeletons = _pickle_schema(leaves, tensors, caller)  # appends the tensors inside other values
            raws = [_as_bytes(t) for t in tensors]  # what the exchange sends: made here, where a failure travels
        except Exception as error:  # whatever fails here fails on this rank only: report it, never leave the others
            problem = error  # waiting in the next collective
    report = None if problem is None else _report(problem)
    sent = _all_gather_object((report, header, skeletons), ranks, group)
    _raise_reported([r for r, _, _ in sent], problem)

    # Each rank's tensors in its own order; a rank's k-th tensor leaf is its tensor k.
    schemas: List[Tuple[Dict[_Path, str], List[_Meta]]] = [pickle.loads(h) for _, h, _ in sent]
    slots = [{p: k for k, p in enumerate(p for p, kind in kinds.items() if kind == "tensor")} for kinds, _ in schemas]
    metas = [m for _, m in schemas]
    check([k for k, _ in schemas], metas, slots)
    comm_device = _comm_device(group)
    per_rank_tensors = _all_gather_tensors(raws, metas, comm_device, group)

    # No collective follows, so whatever raises from here on cannot leave another rank waiting.
    per_rank_skeletons = [pickle.loads(s) if s else {} for _, _, s in sent]
    merged: Dict[Any, Any] = {}
    position = {path: k for k, path in enumerate(schemas[0][0])}  # the same keys everywhere (checked above)
    for path, local in sorted(leaves.items(), key=lambda leaf: position[leaf[0]]):  # rank 0's order, on every rank
        if isinstance(local, torch.Tensor):
            value = _cat_rows([ts[slot[path]] for ts, slot in zip(per_rank_tensors, slots)]).to(local.device)
        else:
            device = next((t.device for t in _tensors_in(local)), comm_device)
            parts = [_restore(s[path], ts, device) for s, ts in zip(per_rank_skeletons, per_rank_tensors)]
            value = _merge_values(_kind(local), parts)
        _set_path(merged, path, value)
    return merged


def _pickle_schema(leaves: Dict[_Path, Any], tensors: List[torch.Tensor], caller: str) -> Tuple[bytes, bytes]:
    """This rank's schema (kinds and tensor metadata) and its non-tensor values with slots for their tensors.

    Appends the tensors inside non-tensor values to ``tensors``. Raises TypeError, naming ``caller`` and the key,
    for a sparse tensor or a value that cannot be pickled.
    """
    for path, value in leaves.items():
        layouts = {_layout(t) for t in _tensors_in(value)} - {str(torch.strided)}
        if layouts:
            raise TypeError(f"{caller} can only send dense tensors, got {sorted(layouts)} in {_name(path)}")
    kinds = {p: _kind(v) for p, v in leaves.items()}
    values = {p: v for p, v in leaves.items() if not isinstance(v, torch.Tensor)}
    leaf_tensors = len(tensors)
    skeletons = {p: _extract(v, tensors) for p, v in values.items()}
    try:
        pickled = pickle.dumps(skeletons) if skeletons else b""
    except Exception:  # a container subclass kept whole may not pickle (a defaultdict of a lambda): only those go
        del tensors[leaf_tensors:]  # as plain containers, so the tensors are taken out again, in the same order
        skeletons = {p: _extract(v, tensors, keep_whole=_picklable) for p, v in values.items()}
        pickled = None
    metas: List[_Meta] = [(tuple(t.shape), t.dtype) for t in tensors]
    try:
        return pickle.dumps((kinds, metas)), pickled if pickled is not None else pickle.dumps(skeletons)
    except Exception as error:  # pickle raises several types, depending on the value
        bad = [_name(p) for p in leaves if not _picklable((p, skeletons.get(p)))]
        where = f" under {_listing(bad)}" if bad else ""
        raise TypeError(f"{caller} cannot pickle the value{where}: {error}") from error


def _layout(tensor: torch.Tensor) -> str:
    """What kind of tensor ``tensor`` is, as far as sending its bytes goes: only ``torch.strided`` can be sent."""
    if tensor.is_nested or tensor.is_quantized or tensor.is_meta:
        return "nested" if tensor.is_nested else "quantized" if tensor.is_quantized else "meta"
    return str(tensor.layout)


def _report(problem: Exception) -> Tuple[Type[Exception], str]:
    """What every rank raises for ``problem``: a TypeError or ValueError as it is, anything else (torch's own
    errors for a tensor it cannot describe, the user's from a generator of values) as a RuntimeError that
    names its type."""
    kind = next((kind for kind in (TypeError, ValueError) if isinstance(problem, kind)), None)
    message = error_message(problem)
    return (kind, message) if kind is not None else (RuntimeError, f"{type(problem).__name__}: {message}")


def _picklable(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


def _raise_reported(reports: List[Optional[Tuple[Type[Exception], str]]], own: Optional[Exception] = None) -> None:
    """Raise what any rank reported, naming the ranks; the same error on every rank, as ``reports`` is gathered.
    On a rank that reported ``own``, it is the error's cause (its traceback shows where it came from)."""
    ranks_of: Dict[Tuple[Type[Exception], str], List[int]] = {}
    for rank, report in enumerate(reports):
        if report is not None:
            ranks_of.setdefault(report, []).append(rank)
    if ranks_of:
        described = [f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {m}" for (_, m), r in ranks_of.items()]
        raise next(iter(ranks_of))[0]("; ".join(described)) from own


# --- process group ---------------------------------------------------------------------------------------------


def _comm_device(group: Optional[Any]) -> torch.device:
    """Where tensors must be to be exchanged: the current CUDA device for NCCL, the CPU otherwise."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_object(obj: Any, ranks: int, group: Optional[Any]) -> List[Any]:
    out: List[Any] = [None] * ranks
    dist.all_gather_object(out, obj, group=group)
    return out


def _all_gather_tensors(
    raws: List[torch.Tensor], metas_per_rank: List[List[_Meta]], device: torch.device, group: Optional[Any]
) -> List[List[torch.Tensor]]:
    """Exchange every rank's tensors (``raws``: this rank's, as :func:`_as_bytes`) as one byte buffer each, padded
    to the longest, in one ``all_gather``.

    Each rank's shapes and dtypes are already known to all ranks, so every rank can size the buffers and cut
    them back into tensors: views, on ``device``, into one buffer that holds the ranks' buffers back to back.
    """
    width = max(sum(_padded_nbytes(m) for m in metas) for metas in metas_per_rank)
    flat = torch.empty(width * len(metas_per_rank), dtype=torch.uint8, device=device)
    received = [flat[rank * width : (rank + 1) * width] for rank in range(len(metas_per_rank))]
    if width > 0:
        _all_gather_bytes(received, _pack(raws, width, device), group)
    return [_unpack(buffer, metas) for buffer, metas in zip(received, metas_per_rank)]


def _all_gather_bytes(received: List[torch.Tensor], local: torch.Tensor, group: Optional[Any]) -> None:
    """``all_gather`` of equal-sized byte buffers; on CPU (Gloo) as concurrent chunks of ``_GLOO_CHUNK_BYTES``.

    Gloo runs asynchronous collectives on several worker threads, so chunks in flight together overlap their
    copies and socket I/O: 2-3x faster than one call for tens of MB (``benchmarks/gather.py``). Every rank
    cuts the same width at the same offsets, so the chunks pair up across ranks.
    """
    size = local.numel()
    chunk = _GLOO_CHUNK_BYTES if local.device.type == "cpu" else size
    works = [
        dist.all_gather(
            [r[start : start + chunk] for r in received], local[start : start + chunk], group, async_op=True
        )
        for start in range(0, size, chunk)
    ]
    for work in works:
        work.wait()


def _pack(raws: List[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    """This rank's tensors' bytes as one ``width``-byte buffer on ``device``, each starting at an aligned offset."""
    if len(raws) == 1 and raws[0].numel() == width and raws[0].device == device:
        return raws[0]  # already exactly the buffer: send it without a copy
    buffer = torch.empty(width, dtype=torch.uint8, device=device)  # padding bytes are sent but never read
    offset = 0
    for raw in raws:
        buffer[offset : offset + raw.numel()].copy_(raw)
        offset += _aligned(raw.numel())
    return buffer


def _unpack(buffer: torch.Tensor, metas: List[_Meta]) -> List[torch.Tensor]:
    tensors = []
    offset = 0
    for shape, dtype in metas:
        nbytes = math.prod(shape) * dtype.itemsize
        tensors.append(buffer[offset : offset + nbytes].view(dtype).view(shape))
        offset += _aligned(nbytes)
    return tensors


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``tensor``; a lazy conjugate or negative view is applied first, since it cannot be viewed."""
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.stride(0) != 1:  # one element, or none, at another stride counts as contiguous (x[:1, 0], x[:0, 0])
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _padded_nbytes(meta: _Meta) -> int:
    shape, dtype = meta
    return _aligned(math.prod(shape) * dtype.itemsize)


# --- structure -------------------------------------------------------------------------------------------------


def _flatten(d: Dict[Any, Any], prefix: _Path = ()) -> Dict[_Path, Any]:
    """Map the key path of every non-dict value (and of every empty dict) to that value."""
    leaves: Dict[_Path, Any] = {}
    for key, value in d.items():
        path = prefix + (key,)
        if isinstance(value, dict) and value:
            leaves.update(_flatten(value, path))
        else:
            leaves[path] = value
    return leaves


def _set_path(d: Dict[Any, Any], path: _Path, value: Any) -> None:
    for key in path[:-1]:
        d = d.setdefault(key, {})
    d[path[-1]] = value


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, dict):
        return "dict"  # at the top of a value only empty dicts, as _flatten unpacks the others
    if isinstance(value, list):
        return "list"
    if isinstance(value, tuple) and not hasattr(value, "_fields"):  # a namedtuple is one object, not a sequence
        return "tuple"
    return "object"


def _extract(value: Any, tensors: List[torch.Tensor], keep_whole: Callable[[Any], bool] = lambda _: True) -> Any:
    """``value`` with every tensor inside lists, tuples and dicts moved to ``tensors`` and left as a slot.

    Those containers are rebuilt as plain ones. A subclass without tensors inside (``torch.Size``, an
    ``OrderedDict`` of numbers) is left whole, so it keeps its type, where ``keep_whole`` says so: the caller
    retries with ``_picklable`` when one does not pickle (a ``defaultdict`` of a lambda then goes as a plain dict).
    Whatever is kept whole holds no tensor, so ``tensors`` gets the same tensors in the same order either way."""
    kind = _kind(value)
    if kind == "tensor":
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    if kind == "object" or (type(value) not in (list, tuple, dict) and not _tensors_in(value) and keep_whole(value)):
        return value
    if kind == "dict":
        return {k: _extract(v, tensors, keep_whole) for k, v in value.items()}
    items = [_extract(v, tensors, keep_whole) for v in value]
    return items if kind == "list" else tuple(items)


def _restore(skeleton: Any, tensors: List[torch.Tensor], device: torch.device) -> Any:
    """Undo :func:`_extract` with one rank's received tensors, copied to ``device``."""
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.index].to(device, copy=True)  # a copy, so the received buffer can be freed
    if type(skeleton) in (list, tuple):  # the plain containers _extract built
        return type(skeleton)(_restore(v, tensors, device) for v in skeleton)
    if type(skeleton) is dict:
        return {k: _restore(v, tensors, device) for k, v in skeleton.items()}
    return skeleton


def _tensors_in(value: Any, found: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
    """The tensors :func:`_extract` takes out of ``value``, in its order, without building anything."""
    found = [] if found is None else found
    kind = _kind(value)
    if kind == "tensor":
        found.append(value)
    elif kind in ("list", "tuple", "dict"):
        for item in value.values() if kind == "dict" else value:
            _tensors_in(item, found)
    return found


def _merge_values(kind: str, parts: List[Any]) -> Any:
    """Merge one key's non-tensor values, given in rank order."""
    if kind == "list":
        return [item for part in parts for item in part]
    if kind == "tuple":
        return tuple(item for part in parts for item in part)
    if kind == "dict":
        return {}
    return list(parts)


def _cat_rows(parts: List[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0, 0-dim tensors counting as one row.

    Parts that already fill their buffer back to back (a lone tensor of the same size on every rank) are
    returned as one view of it instead of being copied; parts that lie back to back in a larger buffer only by
    chance are copied, or a small result would keep the whole buffer alive.
    """
    parts = [p.reshape(1) if p.dim() == 0 else p for p in parts]
    contiguous = all(a.data_ptr() + a.nbytes == b.data_ptr() for a, b in zip(parts, parts[1:]))
    if contiguous and sum(p.nbytes for p in parts) == parts[0].untyped_storage().nbytes():
        first = parts[0]
        rows = sum(p.shape[0] for p in parts)
        return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
    return torch.cat(parts)


def _check_schemas(kinds: List[Dict[_Path, str]], metas: List[List[_Meta]], slots: List[Dict[_Path, int]]) -> None:
    """Raise if the ranks' dicts cannot be merged; identical on every rank, since the input is gathered.

    ``slots[r]`` maps each tensor leaf of rank ``r`` to its position in ``metas[r]``.
    """
    all_paths = set().union(*kinds)
    differing = sorted((p for p in all_paths if any(p not in k for k in kinds)), key=repr)
    if differing:
        described = [f"{_name(p)} (only on ranks {[r for r, k in enumerate(kinds) if p in k]})" for p in differing]
        raise ValueError("sync_dicts: ranks hold different keys: " + _listing(described))
    for path in sorted(all_paths, key=repr):
        found = [k[path] for k in kinds]
        if len(set(found)) > 1:
            raise ValueError(f"sync_dicts: {_name(path)} holds {_by_rank(found)}; every rank needs the same kind")
    for path in slots[0]:
        found_metas = [m[s[path]] for m, s in zip(metas, slots)]
        trailing = [shape[1:] for shape, _ in found_metas]
        if len(set(trailing)) > 1:
            raise ValueError(
                f"sync_dicts: tensors under {_name(path)} have trailing shapes {_by_rank(trailing)}; "
                "only the first dim may differ between ranks"
            )
        dtypes = [dtype for _, dtype in found_metas]
        if len(set(dtypes)) > 1:
            raise ValueError(f"sync_dicts: tensors under {_name(path)} have dtypes {_by_rank(dtypes)}")


def _check_gathered(kinds: List[Dict[_Path, str]], metas: List[List[_Meta]], slots: List[Dict[_Path, int]]) -> None:
    """:func:`_check_schemas` for :func:`gather_in_order`, in the words of its arguments.

    Its ``indices`` are 1-D int64 on every rank by then, so only ``values`` can differ: in kind, or as tensors
    in trailing shape or dtype. A rank without samples that passes ``torch.empty(0)`` or ``[]`` is the usual
    cause, so the error spells out the empty tensor that rank should pass where the others agree on one.
    """
    path = ("values",)
    elsewhere = [rank for rank, k in enumerate(kinds) if path not in k]
    if elsewhere:  # their schema is another call's (sync_dicts): every rank must make the same calls, in order
        raise ValueError(
            f"gather_in_order: rank(s) {elsewhere} made another call of lightning_ddp_ext.sync here (sync_dicts?);"
            " every rank must call the same functions in the same order"
        )
    found = [k[path] for k in kinds]
    tensor_metas = [m[s[path]] for m, s, kind in zip(metas, slots, found) if kind == "tensor"]
    rows = {(shape[1:], dtype) for shape, dtype in tensor_metas if shape and shape[0] > 0}
    hint = ""
    if len(rows) == 1:  # the ranks with samples agree on what one sample is
        trailing, dtype = next(iter(rows))
        hint = f"; a rank without samples passes torch.empty({(0, *trailing)}, dtype={dtype})"
    if len(set(found)) > 1:
        raise ValueError(
            f"gather_in_order: values is {_by_rank([f'a {kind}' for kind in found])}; every rank must pass the same "
            f"kind, a tensor whose first dim runs over samples or a list of per-sample objects{hint}"
        )
    if found[0] == "tensor" and len({(shape[1:], dtype) for shape, dtype in tensor_metas}) > 1:
        raise ValueError(
            f"gather_in_order: values has shape and dtype {_by_rank([f'{s} {d}' for s, d in tensor_metas])}; "
            f"ranks may differ only in dim 0 (the number of samples){hint}"
        )
    _check_schemas(kinds, metas, slots)


def _name(path: _Path) -> str:
    return repr(".".join(str(key) for key in path))


def _by_rank(values: List[Any]) -> str:
    return ", ".join(f"{v} on rank {r}" for r, v in enumerate(values))


def _listing(items: List[str]) -> str:
    more = f" and {len(items) - _MAX_NAMED} more" if len(items) > _MAX_NAMED else ""
    return ", ".join(items[:_MAX_NAMED]) + more


# --- ordering by dataset index ---------------------------------------------------------------------------------


def _as_index_tensor(indices: Union[torch.Tensor, Sequence[int]]) -> torch.Tensor:
    """``indices`` as a 1-D int64 CPU tensor, or an error in :func:`gather_in_order`'s words saying what to pass.

    TypeError for something that holds no numbers, ValueError for numbers of the wrong dtype or shape: per-batch
    index tensors, as a prediction loop collects them, are named as such since ``torch.cat`` is the fix.
    """
    if isinstance(indices, torch.Tensor):
        index = indices
    elif isinstance(indices, np.ndarray) and indices.dtype.kind in "biuf":  # whole, not one Python int per index
        if indices.dtype.kind == "u" and indices.size and int(indices.max()) >= 2**63:
            raise ValueError(f"gather_in_order: {_INDEX_RULE}; an index does not fit in 64 bits")
        index = torch.from_numpy(np.ascontiguousarray(indices, np.int64 if indices.dtype.kind == "u" else None))
    else:
        if isinstance(indices, (str, bytes)) or not isinstance(indices, Iterable):
            raise TypeError(f"gather_in_order: {_INDEX_RULE}; got {type(indices).__name__}")
        items = list(indices)
        try:
            index = torch.as_tensor(items)
        except (TypeError, ValueError, RuntimeError, OverflowError):  # torch's words for what is no index
            raise _not_indices(items) from None
        if index.dim() > 1 and any(map(_is_batch, items)):  # equal-sized batches make a 2-D tensor
            raise _not_indices(items)
    if index.numel() == 0:
        index = index.to(torch.int64)  # an empty list has no integer dtype to infer
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise ValueError(f"gather_in_order: {_INDEX_RULE}; got dtype {index.dtype}")
    if index.dim() != 1:
        raise ValueError(
            f"gather_in_order: {_INDEX_RULE}; got shape {tuple(index.shape)}: torch.cat per-batch indices along "
            "dim 0, or flatten them"
        )
    return index.to("cpu", torch.int64)


def _not_indices(items: List[Any]) -> Exception:
    """Why ``items``, which torch could not make a tensor of, are not one index per sample: per-batch indices
    (ValueError, the fix is ``torch.cat``), something that is no number (TypeError), or an integer past 64 bits.
    Only looked into after torch failed, so valid indices cost no Python step each."""
    batches = sum(map(_is_batch, items))
    if batches:
        return ValueError(
            f"gather_in_order: indices holds {batches} batches of indices, not one index per sample; "
            "torch.cat your per-batch indices (and values) along dim 0 before calling gather_in_order"
        )
    bad = next(((i, x) for i, x in enumerate(items) if not _is_number(x)), None)
    if bad is None:
        return ValueError(f"gather_in_order: {_INDEX_RULE}; an index does not fit in 64 bits")
    return TypeError(f"gather_in_order: {_INDEX_RULE}; got {type(bad[1]).__name__} at position {bad[0]}")


def _is_batch(item: Any) -> bool:
    """Whether ``item``, found among indices, holds several of them (a batch's), so cannot be one index."""
    if isinstance(item, (torch.Tensor, np.ndarray)):
        return item.ndim > 0 and math.prod(item.shape) > 1
    return isinstance(item, (list, tuple)) and len(item) > 1


def _is_number(item: Any) -> bool:
    return isinstance(item, (int, float, np.number)) or (isinstance(item, torch.Tensor) and item.numel() == 1)


def _looks_per_batch(values: Any, count: int) -> bool:
    """Whether ``values`` is a list of tensors whose rows add up to ``count``: per-batch outputs, as a prediction
    loop collects them, where per-sample values were expected."""
    if isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
        return False
    batches = [v for v in values if isinstance(v, torch.Tensor) and v.dim() > 0]
    return len(batches) == len(values) > 0 and sum(len(v) for v in batches) == count


#: Appended to an error about a per-batch list of values (see ``_looks_per_batch``).
_PER_BATCH_HINT = "values looks like per-batch outputs: torch.cat them along dim 0 before calling gather_in_order"


def _per_sample(values: Union[torch.Tensor, Sequence[Any]], count: int) -> Union[torch.Tensor, List[Any]]:
    """``values`` as a tensor or list of ``count`` samples, or an error saying what to pass instead.

    A list of tensors whose rows add up to ``count`` is per-batch outputs, as a prediction loop collects them;
    the error says so, since ``torch.cat`` is the fix.
    """
    if isinstance(values, torch.Tensor) and values.dim() == 0:
        raise ValueError(
            "gather_in_order needs values with a sample dimension, got a 0-dim tensor; for one sample pass "
            "values.reshape(1)"
        )
    not_samples = _not_samples_error(values)
    if not_samples is not None:
        raise not_samples
    samples = values if isinstance(values, torch.Tensor) else list(values)
    if len(samples) != count:
        hint = _PER_BATCH_HINT if _looks_per_batch(samples, count) else "pass one index per sample (row) of values"
        raise ValueError(f"gather_in_order got {len(samples)} values but {count} indices; {hint}")
    return samples


def _not_samples_error(values: Any, sized: bool = False) -> Optional[TypeError]:
    """The error for ``values`` that hold no samples in order (a dict, a set, a string, a number), else None;
    with ``sized``, also for an iterable without ``len()`` (a generator), for callers that count or slice it."""
    if isinstance(values, torch.Tensor):
        return None
    unordered = isinstance(values, (str, bytes, Mapping, set, frozenset))
    if not isinstance(values, Iterable) or unordered or (sized and not isinstance(values, Sized)):
        return TypeError(
            "gather_in_order: values must be a tensor whose first dim runs over samples or a sequence"
            f"{' (with len())' if sized else ''} of per-sample objects, got {type(values).__name__}"
        )
    return None


def _dedupe_in_order(
    values: Union[torch.Tensor, List[Any]], index: torch.Tensor, dataset_size: Optional[int]
) -> Union[torch.Tensor, List[Any]]:
    """``values`` sorted by ``index`` with repeated indices dropped, after checking the repeats agree.

    The stable sort keeps the gathered (rank) order among repeats, so the first of each run is the copy from the
    lowest rank: it is kept, and every other copy is compared with it.
    """
    order = torch.argsort(index, stable=True)
    sorted_index = index[order]
    first = torch.ones_like(sorted_index, dtype=torch.bool)
    first[1:] = sorted_index[1:] != sorted_index[:-1]
    repeats = (~first).nonzero().flatten()
    kept = first.nonzero().flatten()[first.cumsum(0) - 1]  # for every sorted position, its run's first position
    later, earlier = order[repeats], order[kept[repeats]]
    if isinstance(values, torch.Tensor):
        later_rows, earlier_rows = (_select_rows(values, i) for i in (later, earlier))
        differs = ~_close_rows(later_rows, earlier_rows).cpu()
    else:
        differs = torch.tensor(
            [not _same(values[i], values[j]) for i, j in zip(later.tolist(), earlier.tolist())], dtype=torch.bool
        )
    conflicts = sorted_index[repeats[differs]].unique().tolist()
    if conflicts:
        hint = ""
        if not isinstance(values, torch.Tensor):
            position = order[repeats[differs][0]].item()
            if _holds_plain_float(values[int(position)]):
                hint = (
                    "; its values hold Python floats, which are compared exactly, but a padded sample computed in a"
                    " batch of another size rounds differently: pass tensors (or numpy arrays), which are compared"
                    " with a tolerance, not .tolist() of them"
                )
        raise ValueError(
            f"gather_in_order: different values for the same index: {_listing([str(i) for i in conflicts])}{hint}"
        )

    unique = sorted_index[first]
    if dataset_size is not None:
        outside = unique[(unique < 0) | (unique >= dataset_size)].tolist()
        if outside:
            raise ValueError(
                f"gather_in_order: indices outside range({dataset_size}): {_listing([str(i) for i in outside])}"
            )
        present = torch.zeros(dataset_size, dtype=torch.bool)
        present[unique] = True
        missing = (~present).nonzero().flatten().tolist()
        if missing:
            raise ValueError(
                f"gather_in_order: {len(missing)} of {dataset_size} indices missing: "
                + _listing([str(i) for i in missing])
            )

    keep = order[first]
    if isinstance(values, torch.Tensor):
        return _select_rows(values, keep)
    return [values[i] for i in keep.tolist()]


#: The unsigned dtypes torch implements no ``index_select`` for (token ids, hashes), each with the signed dtype of
#: its width, through whose view their rows are selected instead.
_SIGNED_VIEWS = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def _select_rows(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values.index_select(0, index)`` for every dtype: rows of uint16/32/64 go through a signed view of the same
    bits, since torch implements no ``index_select`` for them."""
    index = index.to(values.device)
    signed = _SIGNED_VIEWS.get(values.dtype)
    if signed is None:
        return values.index_select(0, index)
    return values.view(signed).index_select(0, index).view(values.dtype)


def _is_nan(value: Any) -> bool:
    return isinstance(value, (float, complex, np.inexact)) and cmath.isnan(value)


def _close_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether each sample (row) of ``a`` is the same value as that of ``b``, as :func:`gather_in_order` says."""
    dtype = a.dtype
    a, b = (a.unsqueeze(1), b.unsqueeze(1)) if a.dim() == 1 else (a.flatten(1), b.flatten(1))
    if not (dtype.is_floating_point or dtype.is_complex):
        return (a == b).all(dim=1)
    if a.numel() == 0:
        return torch.ones(len(a), dtype=torch.bool, device=a.device)
    wide = torch.complex128 if dtype.is_complex else torch.float64  # so differences and scales cannot overflow
    a, b = a.to(wide), b.to(wide)
    magnitudes = torch.cat([a.abs(), b.abs()], dim=1)
    scale = torch.where(magnitudes.isfinite(), magnitudes, 0).amax(dim=1, keepdim=True)
    tolerance = _computed_eps(dtype) ** 0.5 * scale + torch.finfo(dtype).tiny  # tiny: subnormals count as 0
    return (torch.isclose(a, b, rtol=0, atol=0, equal_nan=True) | ((a - b).abs() <= tolerance)).all(dim=1)


#: The machine epsilon of TF32 (10 explicit mantissa bits), in which CUDA may compute float32 convolutions and
#: matrix products.
_TF32_EPS = 2.0**-10


def _computed_eps(dtype: torch.dtype) -> float:
    """The epsilon of the precision ``dtype``'s values were computed in: TF32's for float32 (and complex64) where
    torch lets CUDA compute float32 in TF32, whichever device the values are on now (a validation step may have
    moved them to the CPU)."""
    eps = float(torch.finfo(dtype).eps)
    if dtype in (torch.float32, torch.complex64) and _tf32_allowed():
        return max(eps, _TF32_EPS)
    return eps


def _tf32_allowed() -> bool:
    cuda = torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
    return bool(cuda) and torch.cuda.is_available()


_TORCH_FLOAT_DTYPES = tuple(map(np.dtype, ("float16", "float32", "float64", "complex64", "complex128")))


def _holds_plain_float(value: Any) -> bool:
    """Whether ``value`` is, or its dicts, lists and tuples hold, a Python float or complex number (numpy's float
    scalars are compared with a tolerance, as arrays)."""
    if isinstance(value, (float, complex)) and not isinstance(value, np.generic):
        return True
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, (list, tuple)) and any(map(_holds_plain_float, value))


def _same(a: Any, b: Any) -> bool:
    """Equality for per-sample objects: tensors and floating-point numpy arrays and scalars as in
    :func:`_close_rows`, other arrays and the rest exactly (arrays of the same dtype and shape); dicts, lists and
    tuples (a per-sample ``{"embedding": tensor, "id": 3}``) and arrays of objects item by item, by these rules.
    An object is the same as itself, and NaNs match (floats, complex numbers, arrays), as in tensors."""
    if a is b or (_is_nan(a) and _is_nan(b)):
        return True
    if isinstance(a, np.generic) and isinstance(b, np.generic):  # elements of 1-D arrays, rows of structured ones:
        a, b = np.asarray(a), np.asarray(b)  # compared as the arrays they came from
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(_close_rows(a.reshape(1, -1), b.reshape(1, -1).to(a.device)).item())
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):  # as tensors: same dtype and shape, NaN matching
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype != b.dtype:  # strings sliced from batches of other widths are still the same strings
            return a.dtype.kind == b.dtype.kind and a.dtype.kind in "US" and bool(np.array_equal(a, b))
        if a.dtype.names:  # structured: field by field, by these rules
            return all(_same(a[name], b[name]) for name in a.dtype.names)
        if a.dtype == object:  # element by element, by these rules (NaN, tensors inside)
            return all(map(_same, np.asarray(a).flat, np.asarray(b).flat))
        if a.dtype in _TORCH_FLOAT_DTYPES:  # with the tolerance of tensors (which have no float128)
            rows = [torch.from_numpy(np.ascontiguousarray(x).reshape(1, -1)) for x in (a, b)]
            return bool(_close_rows(*rows).item())
        try:
            return bool(np.array_equal(a, b, equal_nan=True))
        except TypeError:  # equal_nan needs numbers: strings and the like are compared as they are
            return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):  # a list equals only a list, as in Python
        return isinstance(a, list) == isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    try:
        return bool(a == b)
    except Exception as error:  # an object whose == is not a truth value (a dataclass of tensors)
        raise TypeError(
            f"gather_in_order cannot compare two values of a repeated index ({type(a).__name__}: {error}); make"
            " each per-sample value a tensor, or a dict, list or tuple of tensors and plain values"
        ) from error
