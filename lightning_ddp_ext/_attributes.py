"""What the sampler wrappers read and set through on the user's object: its data attributes, unless the
wrapper's own code is the one setting them. Framework-free (no Lightning)."""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Dict, FrozenSet, List, Tuple

_MISSING = object()


def found_on_class(cls: type, name: str) -> bool:
    """Whether ``cls`` or a base defines ``name`` (a method, a property, a class-level value, even ``None``),
    found without running any code of the class."""
    return inspect.getattr_static(cls, name, _MISSING) is not _MISSING


def is_data_attribute(obj: Any, name: str) -> bool:
    """Whether ``name`` is a data attribute of ``obj``: in its ``__dict__``, a slot, a property, a
    ``functools.cached_property`` (computed or not yet), or a plain class-level value; not a method or another
    non-data descriptor."""
    if name in getattr(obj, "__dict__", ()):
        return True
    found = inspect.getattr_static(type(obj), name, _MISSING)
    if found is _MISSING:
        return False
    if isinstance(found, functools.cached_property):  # a value once computed, set in the instance's __dict__
        return True
    kind = type(found)
    return hasattr(kind, "__set__") or not (callable(found) or hasattr(kind, "__get__"))


_CODE_OF_METHODS: Dict[Tuple[type, type], FrozenSet[types.CodeType]] = {}


def code_of_methods(cls: type, base: type) -> FrozenSet[types.CodeType]:
    """The code of every function that ``cls`` and its bases down to ``base`` define (methods, properties'
    accessors, class and static methods, what decorators wrap), with the code nested in it (closures, lambdas,
    comprehensions): a frame running any of it is the wrapper's own code. Worked out once per class."""
    known = _CODE_OF_METHODS.get((cls, base))
    if known is not None:
        return known
    pending: List[types.CodeType] = []
    for klass in cls.__mro__:
        if not issubclass(klass, base):
            continue
        for value in vars(klass).values():
            if isinstance(value, (classmethod, staticmethod)):
                value = value.__func__
            functions = [value.fget, value.fset, value.fdel] if isinstance(value, property) else [value]
            for function in functions:
                while function is not None:  # a decorated method: its wrapper's code and the wrapped one's
                    code = getattr(function, "__code__", None)
                    if isinstance(code, types.CodeType):
                        pending.append(code)
                    function = getattr(function, "__wrapped__", None)
    codes = set()
    while pending:
        code = pending.pop()
        if code not in codes:
            codes.add(code)
            pending += [const for const in code.co_consts if isinstance(const, types.CodeType)]
    _CODE_OF_METHODS[cls, base] = frozenset(codes)
    return _CODE_OF_METHODS[cls, base]
