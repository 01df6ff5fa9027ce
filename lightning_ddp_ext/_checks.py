"""Checks of the arguments that the sampler wrappers, ``patch_dataloader_to_ddp``, the strategy and ``sync`` share.

One place, so that a mistake gets the same message whichever entry point it came through, naming the entry
point (``owner``) and saying what to pass instead. Framework-free (torch and numpy only).
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import numpy as np
import torch.distributed as dist

from lightning_ddp_ext._store import is_bool

# Seeds: 64-bit signed, so that seed + epoch, which seeds torch's generators here and in DistributedSampler, never
# overflows what torch.Generator.manual_seed takes (up to 2**64 - 1).
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1


def resolve_world(num_replicas: Optional[int], rank: Optional[int], owner: str) -> tuple[int, int]:
    """``(num_replicas, rank)`` as ints, each taken from the default process group where it is None; an error
    naming ``owner`` when there is no group to take it from, or for a world below 1 or a rank outside it."""
    if num_replicas is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{owner} needs num_replicas and rank: pass them explicitly, or initialise the default process"
                " group (torch.distributed.init_process_group) before creating it."
            )
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
    world, own_rank = integer_or_none(num_replicas), integer_or_none(rank)
    if world is None or world < 1:
        raise ValueError(f"{owner}: num_replicas must be an integer >= 1, got {num_replicas!r}.")
    if own_rank is None or not 0 <= own_rank < world:
        raise ValueError(f"{owner}: rank must be an integer in [0, {world - 1}], got {rank!r}.")
    return world, own_rank


def integer_or_none(value: Any) -> Optional[int]:
    """``value`` as an int if it is an integer (a numpy or torch integer too, not a bool of any kind), else None."""
    if is_bool(value):  # operator.index(torch.tensor(True)) is 1
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_shuffle_window(shuffle_window: Optional[int], owner: str) -> Optional[int]:
    """``shuffle_window`` as an int (a numpy or torch integer too) or None; a ValueError naming ``owner`` unless
    it is None or an integer >= 1."""
    if shuffle_window is None:
        return None
    window = integer_or_none(shuffle_window)
    if window is None or window < 1:
        raise ValueError(f"{owner}: shuffle_window must be None or an integer >= 1, got {shuffle_window!r}.")
    return window


def check_seed(seed: Any, owner: str) -> int:
    """``seed`` as an int (a numpy or torch integer too); a ValueError naming ``owner`` for anything else, which
    would only fail at the first epoch, in torch's words (it seeds a generator with ``seed + epoch``)."""
    checked = integer_or_none(seed)
    if checked is None or not SEED_MIN <= checked <= SEED_MAX:
        raise ValueError(
            f"{owner}: seed must be an integer in [-2**63, 2**63 - 1], got {seed!r} (torch seeds a generator with"
            " seed + epoch, which must stay below 2**64)."
        )
    return checked


def check_flag(value: Any, name: str, owner: str) -> bool:
    """``value`` as a bool (a numpy bool too); a ValueError naming ``owner`` for anything else, so that a
    string such as ``"no"`` is not taken as true."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{owner}: {name} must be True or False, got {value!r}.")
    return bool(value)


def length_of(source: Any, subject: str, fix: str) -> int:
    """``len(source)``, or a TypeError that says ``subject`` (``"len() of ..."``) raised and what to do (``fix``).
    TypeError and NotImplementedError are how classes say "not sized" (IterableDataset-like ones)."""
    try:
        return len(source)
    except (TypeError, NotImplementedError) as error:
        raised = type(error).__name__ + (f" ({error})" if str(error) else "")
        raise TypeError(f"{subject} raised {raised}. {fix}") from error


def nothing_to_deal(name: str, world: int) -> ValueError:
    """The error for an empty sampler or dataset ``name``, which would give each of ``world`` ranks nothing."""
    return ValueError(
        f"{name} is empty (len() == 0): there is nothing to deal out among {world} ranks. Check the dataset and"
        " the sampler's arguments."
    )


def fewer_items_than_ranks(what: str, world: int) -> ValueError:
    """The error for ``pad=False`` with fewer items than ranks; ``what`` says what has how many items."""
    return ValueError(
        f"{what}, fewer than the {world} ranks, and pad=False drops the incomplete round: every rank would get"
        " nothing. Use pad=True, fewer ranks, or more data."
    )
