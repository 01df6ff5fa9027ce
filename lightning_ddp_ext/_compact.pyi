"""Types of the optional C helpers built from _compact.c (see _store.py and samplers.py for their use)."""
from typing import Any, Callable, Iterator, List, Optional, Tuple

class Store:
    itemsize: int
    def __init__(self, batched: bool, convert: Callable[[Any], bytes], expected: int = 0) -> None: ...
    def __len__(self) -> int: ...
    def read(self, items: Iterator[Any], actions: bytes) -> Tuple[List[Any], int]: ...
    def lists(self, slots: Any) -> List[Any]: ...  # slots: a C-contiguous int64 buffer

class WindowDealer(Iterator[Any]):
    read: int
    def __init__(
        self,
        items: Iterator[Any],
        seed: Optional[int],
        window: int,
        world: int,
        rank: int,
        first: int,
        end: int,
        sample_windows: Any,  # ascending window indices: a C-contiguous int64 buffer
        on_sample: Optional[Callable[[Any], Any]],
    ) -> None: ...
    def __next__(self) -> Any: ...

def window_permutations(seed: int, first: int, count: int, size: int, stride: int, out: Any) -> None: ...
def exact_int_tuple(item: Any) -> Optional[Tuple[int, ...]]: ...
SOURCE_DIGEST: str
