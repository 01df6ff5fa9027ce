"""Name the object that cannot be pickled, for launchers that pickle what they send to the ranks.

``spawn`` and ``forkserver`` pickle the trainer, the model and the dataloaders for every rank. When one
object deep inside (a lock held by a batch sampler, a lambda as ``collate_fn``) cannot be pickled, pickle
only says ``cannot pickle '_thread.lock' object``; :func:`unpicklable_path` walks down to it instead.
Only called after pickling failed, so a successful launch costs nothing. :func:`error_message` makes an
error's message safe to send to the other ranks. No Lightning import here.
"""
from __future__ import annotations

import functools
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterator, List, Optional, Tuple

__all__ = ["unpicklable_path", "error_message", "PICKLING_ERRORS"]

#: What pickling raises for an object it cannot handle.
PICKLING_ERRORS = (TypeError, AttributeError, pickle.PicklingError)

_MAX_DEPTH = 8


def _pickles(obj: Any) -> bool:
    try:
        ForkingPickler.dumps(obj)  # what multiprocessing itself uses
    except Exception:  # noqa: BLE001 - any failure means "not this way"
        return False
    return True


def _parts(obj: Any) -> Iterator[Tuple[str, Any]]:
    """``(how to reach it, part)`` for what pickling ``obj`` pickles in turn."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"[{key!r}]", value
            yield f"key {key!r}", key
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for index, value in enumerate(obj):
            yield f"[{index}]", value
    elif isinstance(obj, functools.partial):
        yield ".func", obj.func
        yield from ((f".args[{index}]", value) for index, value in enumerate(obj.args))
        yield from ((f".keywords[{key!r}]", value) for key, value in obj.keywords.items())
    elif _customises_pickling(type(obj)):
        yield from _reduced_parts(obj)
    else:
        yield from ((f".{name}", value) for name, value in getattr(obj, "__dict__", {}).items())
        for name in _slot_names(type(obj)):
            if hasattr(obj, name):
                yield f".{name}", getattr(obj, name)


_PICKLING_HOOKS = ("__reduce_ex__", "__reduce__", "__getstate__")


def _customises_pickling(cls: type) -> bool:
    """Whether ``cls`` decides itself what pickling it pickles (``__getstate__``, ``__reduce__``...)."""
    return any(getattr(cls, name, None) is not getattr(object, name, None) for name in _PICKLING_HOOKS)


def _reduced_parts(obj: Any) -> Iterator[Tuple[str, Any]]:
    """The parts of what ``obj``'s own reduction hands pickle: its arguments and its state (not its attributes,
    some of which it may leave out or replace). Nothing when the reduction itself fails: ``obj`` is the culprit."""
    try:
        reduced = obj.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    except Exception:  # noqa: BLE001 - it cannot say what it pickles
        return
    if not isinstance(reduced, tuple):  # a global's name
        return
    arguments = reduced[1] if len(reduced) > 1 and isinstance(reduced[1], tuple) else ()
    yield from ((f"(reduced) args[{index}]", value) for index, value in enumerate(arguments))
    state = reduced[2] if len(reduced) > 2 else None
    if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots), as object's default gives with slots
        states = [part for part in state if isinstance(part, dict)]
    else:
        states = [state] if isinstance(state, dict) else []
    for names in states:
        yield from ((f".{name}" if isinstance(name, str) else f"[{name!r}]", value) for name, value in names.items())
    if state is not None and not states:
        yield "(its state)", state


def _slot_names(cls: type) -> Iterator[str]:
    """The ``__slots__`` attributes of ``cls`` and its bases (``__dict__`` and ``__weakref__`` aside)."""
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__"):
                yield name


def unpicklable_path(root: Any, name: str) -> Optional[str]:
    """Describe the innermost part of ``root`` that cannot be pickled, or None when ``root`` pickles.

    Example:
        >>> import threading
        >>> class Sampler:
        ...     def __init__(self):
        ...         self.lock = threading.Lock()
        >>> unpicklable_path({"sampler": Sampler()}, "loaders")
        "loaders (dict) -> ['sampler'] (Sampler) -> .lock (lock)"
        >>> unpicklable_path([1, 2], "numbers") is None
        True
    """
    if _pickles(root):
        return None
    chain: List[str] = [f"{name} ({type(root).__name__})"]
    current = root
    seen = {id(root)}
    for _ in range(_MAX_DEPTH):
        culprit = next(
            ((step, part) for step, part in _parts(current) if id(part) not in seen and not _pickles(part)), None
        )
        if culprit is None:
            break
        step, current = culprit
        seen.add(id(current))
        chain.append(f"{step} ({type(current).__name__})")
    return " -> ".join(chain)


def error_message(error: BaseException) -> str:
    """``str(error)`` as a plain str, which always pickles (a str subclass may not), for sending to other ranks;
    a placeholder when the error's ``__str__`` fails."""
    try:
        return str.__str__(str(error))
    except Exception:  # noqa: BLE001 - the report must go out whatever the error does
        return "(its message could not be made)"
