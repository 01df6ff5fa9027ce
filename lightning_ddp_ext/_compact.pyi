"""Types of the optional C helper built from _compact.c (see _store.py for how it is used)."""
from typing import Any, Callable, Iterator, List, Tuple

def read(
    items: Iterator[Any], actions: bytes, batched: bool, convert: Callable[[Any], bytes]
) -> Tuple[bytes, List[int], List[Any], int]: ...
def lists(flat: Any, offsets: Any, slots: Any) -> List[List[int]]:  # three C-contiguous int64 buffers
    ...
