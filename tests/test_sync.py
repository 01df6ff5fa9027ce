"""Tests for lightning_ddp_ext.sync on real gloo process groups.

Spawning costs seconds, so each world size runs one worker that exercises every case and returns what it saw;
the test functions below only compare those results with expectations written out from the rules. Calls that
only one rank gets wrong run in a worker of their own, so a rank left waiting fails that run alone.
"""
from __future__ import annotations

import math
import pickle
import warnings
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed_helpers import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_ddp_ext import sync
from lightning_ddp_ext.sync import gather_in_order, sync_dicts

NOT_A_DICT = "sync_dicts expects a dict, got list; wrap it in one: {'name': value}"
ROWS = (3, 0, 5)  # first-dim size per rank: uneven, and rank 1 has none
DATASET = 7  # not a multiple of 2 or 3, so a distributed sampler has to pad with repeats


# --- data both the workers and the assertions are built from -----------------------------------------------------


def _payload(rank: int) -> Dict[str, Any]:
    n = ROWS[rank]
    g = torch.Generator().manual_seed(rank)
    return {
        "emb": torch.randn(n, 4, generator=g),
        "ids": torch.arange(n) + 100 * rank,
        "flags": torch.arange(n) % 2 == rank % 2,
        "bf16": torch.randn(n, 3, generator=g).to(torch.bfloat16),
        "loss": torch.tensor(rank + 0.5),
        "big": torch.randn(20 * n, 256, generator=g),
        "names": [f"r{rank}s{i}" for i in range(n)],
        "pair": (rank, str(rank)),
        "step": {"epoch": 3, "rank": rank},
        "seqs": [torch.full((i + 1,), rank, dtype=torch.int32) for i in range(n)],
        "nested": {"inner": torch.full((n, 2), float(rank), dtype=torch.float64), "deeper": {"tags": [f"t{rank}"]}},
        "none": None,
        "empty": {},
    }


def _expected_merge(world_size: int) -> Dict[str, Any]:
    parts = [_payload(r) for r in range(world_size)]

    def cat(*keys: str) -> torch.Tensor:
        return torch.cat([_get(p, keys) for p in parts])

    return {
        "emb": cat("emb"),
        "ids": cat("ids"),
        "flags": cat("flags"),
        "bf16": cat("bf16"),
        "loss": torch.tensor([r + 0.5 for r in range(world_size)]),
        "big": cat("big"),
        "names": [name for p in parts for name in p["names"]],
        "pair": tuple(item for p in parts for item in p["pair"]),
        "step": {"epoch": [3] * world_size, "rank": list(range(world_size))},
        "seqs": [t for p in parts for t in p["seqs"]],
        "nested": {"inner": cat("nested", "inner"), "deeper": {"tags": [f"t{r}" for r in range(world_size)]}},
        "none": [None] * world_size,
        "empty": {},
    }


def _get(d: Dict[str, Any], keys: Tuple[str, ...]) -> Any:
    for key in keys:
        d = d[key]
    return d


def _equal_rows(rank: int) -> torch.Tensor:
    return torch.arange(12.0).reshape(4, 3) + 100 * rank


def _bad_inputs(rank: int) -> Dict[str, Dict[str, Any]]:
    """Inputs that cannot be merged; rank 0 differs from the others."""
    first = rank == 0
    return {
        "keys": {"a": 1, ("only_first" if first else "only_rest"): 2},
        "nested_keys": {"n": {("x" if first else "y"): 1}},
        "trailing": {"t": torch.zeros(2, 3 if first else 4)},
        "dtype": {"t": torch.zeros(2, dtype=torch.float32 if first else torch.float64)},
        "kind": {"t": torch.zeros(2) if first else [0.0, 0.0]},
    }


def _sampler_indices(rank: int, world_size: int) -> torch.Tensor:
    """What DistributedSampler(shuffle=True) gives ``rank``: a permutation, padded with its own head, dealt out."""
    perm = torch.randperm(DATASET, generator=torch.Generator().manual_seed(0))
    padded_len = -(-DATASET // world_size) * world_size
    padded = torch.cat([perm, perm[: padded_len - DATASET]])
    return padded[rank::world_size]


def _value_of(index: torch.Tensor) -> torch.Tensor:
    return torch.stack([index * 1.5, -index.double()], dim=1)


def _one_ulp_up_on_odd_ranks(index: torch.Tensor, rank: int) -> torch.Tensor:
    """:func:`_value_of`, one ulp larger on odd ranks: a padded repeat rounded differently by its rank."""
    value = _value_of(index)
    return torch.nextafter(value, torch.full_like(value, math.inf)) if rank % 2 else value


def _first_copies(world_size: int) -> torch.Tensor:
    """What gathering :func:`_one_ulp_up_on_odd_ranks` must give: for each index, the copy of its lowest rank."""
    ranks = [next(r for r in range(world_size) if i in _sampler_indices(r, world_size)) for i in range(DATASET)]
    return torch.cat([_one_ulp_up_on_odd_ranks(torch.tensor([i]), r) for i, r in enumerate(ranks)])


LINEAR_SAMPLES = 101  # odd, so DistributedSampler pads: index 0 is computed again on the last rank


def _linear_embeddings(rank: int, world_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of Linear(128, 128) embeddings, in batches of 16, as DistributedSampler deals them.

    The padded copy of index 0 is computed in the last rank's short final batch, and the CPU matmul rounds
    batches of different sizes differently, so its bits need not equal those of the copy on rank 0.
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 128)
    data = TensorDataset(torch.randn(LINEAR_SAMPLES, 128, generator=torch.Generator().manual_seed(1)))
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
    with torch.no_grad():
        embeddings = [model(x) for (x,) in DataLoader(data, batch_size=16, sampler=sampler)]
    return torch.cat(embeddings), torch.tensor(list(sampler))


# --- the workers ---------------------------------------------------------------------------------------------------


def _error_of(call: Callable[[], Any]) -> Optional[Tuple[str, str]]:
    try:
        call()
    except Exception as error:  # reported to the parent, which checks type and message
        return type(error).__name__, str(error)
    return None


def _attempt(call: Callable[[], Any]) -> Any:
    """The result of ``call``, or its error as :func:`_error_of` describes it."""
    try:
        return call()
    except Exception as error:
        return type(error).__name__, str(error)


def _contains_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, bytes) and obj.startswith(b"\x80"):  # sent pickled by sync itself
        return _contains_tensor(pickle.loads(obj))
    if isinstance(obj, dict):
        return any(_contains_tensor(k) or _contains_tensor(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return any(_contains_tensor(v) for v in obj)
    return False


def _sync_worker(rank: int, world_size: int) -> Dict[str, Any]:
    results: Dict[str, Any] = {}

    sent_as_objects: List[Any] = []
    original = dist.all_gather_object

    def recording(object_list: List[Any], obj: Any, group: Any = None) -> None:
        sent_as_objects.append(obj)
        original(object_list, obj, group=group)

    dist.all_gather_object = recording
    try:
        results["merged"] = sync_dicts(_payload(rank))
    finally:
        dist.all_gather_object = original
    results["object_payload_has_tensor"] = _contains_tensor(sent_as_objects)
    results["object_payload_bytes"] = len(pickle.dumps(sent_as_objects))

    # The same exchange cut into many small concurrent chunks, whose edges fall inside tensors.
    chunk_bytes = sync._GLOO_CHUNK_BYTES
    sync._GLOO_CHUNK_BYTES = 1000
    try:
        results["merged_in_chunks"] = sync_dicts(_payload(rank))
    finally:
        sync._GLOO_CHUNK_BYTES = chunk_bytes

    # Same size on every rank and nothing else to send: the received buffer itself is the result.
    results["equal_rows"] = sync_dicts({"x": _equal_rows(rank)})["x"]
    # Rank 0's last tensor and rank 1's first lie back to back in the received buffer, by chance of order and
    # size: the small result must be a copy, not a view that keeps the whole buffer alive.
    big, small = torch.zeros(1000), torch.ones(8)
    by_chance = sync_dicts({"big": big, "small": small} if rank == 0 else {"small": small, "big": big})
    results["small_result_storage"] = by_chance["small"].untyped_storage().nbytes()
    results["errors"] = {name: _error_of(lambda d=d: sync_dicts(d)) for name, d in _bad_inputs(rank).items()}
    results["errors"]["world_size"] = _error_of(lambda: sync_dicts({"a": 1}, world_size=world_size + 1))
    results["after_errors"] = sync_dicts({"rank": rank}, world_size=world_size)  # still in step after raising

    index = _sampler_indices(rank, world_size)
    results["order_tensor"] = gather_in_order(_value_of(index), index, dataset_size=DATASET)
    results["order_objects"] = gather_in_order([f"s{i}" for i in index.tolist()], index.tolist(), DATASET)
    per_sample_dicts = [{"emb": _value_of(torch.tensor([i]))[0], "id": i} for i in index.tolist()]
    results["order_dicts"] = _attempt(lambda: gather_in_order(per_sample_dicts, index, DATASET))
    results["subclasses"] = sync_dicts({"shape": [torch.Size([2, rank])], "od": [OrderedDict(b=rank, a=1)]})
    unpicklable = defaultdict(lambda: 0, a=rank) if rank == 0 else {"a": rank}  # goes as a plain dict
    results["unpicklable_subclass"] = sync_dicts({"x": [unpicklable], "kept": [OrderedDict(a=rank)]})
    start = sum(ROWS[:rank])
    uneven = torch.arange(start, start + ROWS[rank]).flip(0)  # reversed, and empty on rank 1
    results["order_uneven"] = gather_in_order(_value_of(uneven), uneven, dataset_size=sum(ROWS[:world_size]))
    results["order_errors"] = {
        "missing": _error_of(lambda: gather_in_order(_value_of(index), index, dataset_size=DATASET + 2)),
        "out_of_range": _error_of(lambda: gather_in_order(_value_of(index), index, dataset_size=DATASET - 1)),
        "conflict_tensor": _error_of(lambda: gather_in_order(_value_of(index) + rank, index)),
        "conflict_objects": _error_of(lambda: gather_in_order([(i, rank) for i in index.tolist()], index)),
        "conflict_small": _error_of(lambda: gather_in_order((_value_of(index).float() + 1) * (1 + 1e-3 * rank), index)),
    }
    # A rank without samples passing an empty tensor or list that does not match the others' outputs.
    first = rank == 0
    own_index = index[:0] if first else index
    results["order_errors"].update(
        empty_rank=_error_of(lambda: gather_in_order(torch.empty(0) if first else _value_of(index), own_index)),
        empty_list=_error_of(lambda: gather_in_order([] if first else _value_of(index), own_index)),
        dtype=_error_of(lambda: gather_in_order(_value_of(index).to(torch.float32 if first else torch.float64), index)),
    )

    # Repeats that differ by rounding only, or are NaN on every rank, are the same sample.
    results["order_one_ulp"] = _attempt(lambda: gather_in_order(_one_ulp_up_on_odd_ranks(index, rank), index, DATASET))
    with_nan = _value_of(index)
    with_nan[:, 1] = math.nan
    results["order_nan"] = _attempt(lambda: gather_in_order(with_nan, index, DATASET))
    embeddings, linear_index = _linear_embeddings(rank, world_size)
    results["linear_local"] = embeddings
    results["linear"] = _attempt(lambda: gather_in_order(embeddings, linear_index, dataset_size=LINEAR_SAMPLES))

    # A conjugate view and a negative view (the imaginary part of a conjugate view) carry lazy bits.
    complex_value = torch.tensor([1 + 2j, 3 - 4j]) * (rank + 1)
    results["conj"] = _attempt(lambda: sync_dicts({"conj": complex_value.conj(), "neg": complex_value.conj().imag}))

    # One element at a stride other than 1 counts as contiguous but cannot be viewed as bytes: on odd ranks only, it
    # failed there after the first exchange, and the others waited in the second.
    grid = torch.arange(6.0).reshape(2, 3) + 10 * rank
    results["one_element_column"] = _attempt(lambda: sync_dicts({"x": grid[:1, 1] if rank % 2 else grid[0, 1:2]}))

    # Keys that compare equal, with different reprs on different ranks: matched as a dict matches them.
    one = np.int64(1) if rank == 0 else 1
    equal_keys = {one: torch.full((1, 2), rank), 5: torch.full((1, 2), 10 + rank)}
    results["equal_keys"] = _attempt(lambda: sync_dicts(equal_keys))

    # Keys inserted in another order on odd ranks, at both levels: every rank gets rank 0's order, so a loop over
    # the result that makes a collective per key (logging with sync_dist=True) pairs the same keys everywhere.
    inner = {"loss": torch.ones(1), "acc": torch.zeros(1)}
    ordered = {"b": dict(reversed(inner.items())) if rank % 2 else inner, "a": [rank]}
    merged = sync_dicts(dict(reversed(ordered.items())) if rank % 2 else ordered)
    results["key_order"] = (list(merged), list(merged["b"]))
    return results


def _lone_bad_call_worker(rank: int, world_size: int) -> Dict[str, Any]:
    """Rank 0 makes each bad call alone, the other ranks a valid one: every rank must raise, none wait."""
    bad = rank == 0
    calls: Dict[str, Callable[[], Any]] = {
        "length": lambda: gather_in_order(torch.zeros(3 if bad else 2, 2), [2 * rank, 2 * rank + 1]),
        "float_indices": lambda: gather_in_order(torch.zeros(2), [0.0, 1.0] if bad else [2, 3]),
        "zero_dim": lambda: gather_in_order(torch.tensor(1.0) if bad else torch.ones(1), [rank]),
        "not_a_dict": lambda: sync_dicts([1] if bad else {"a": 1}),  # type: ignore[arg-type]
        "sparse": lambda: sync_dicts({"t": torch.eye(2).to_sparse() if bad else torch.eye(2)}),
        "unpicklable": lambda: sync_dicts({"f": (lambda: 0) if bad else 1}),
        "world_size": lambda: sync_dicts({"a": 1}, world_size=world_size + 1 if bad else world_size),
        "str_world_size": lambda: sync_dicts(
            {"a": 1}, world_size=str(world_size) if bad else world_size  # type: ignore[arg-type]
        ),
        "float_dataset_size": lambda: gather_in_order(
            [0, 1], [2 * rank, 2 * rank + 1], 4.0 if bad else 4  # type: ignore[arg-type]
        ),
        "negative_dataset_size": lambda: gather_in_order([0, 1], [2 * rank, 2 * rank + 1], -1 if bad else 4),
        "none_index": lambda: gather_in_order(
            torch.zeros(2, 1), [0, None] if bad else [2, 3]  # type: ignore[list-item]
        ),
        "zero_world_size": lambda: sync_dicts({"a": 1}, world_size=0 if bad else world_size),
        "per_batch_indices": lambda: gather_in_order(
            [torch.zeros(2, 3)] * 2 if bad else torch.zeros(2, 3),
            [torch.arange(2), torch.arange(2, 4)] if bad else [4, 5],
        ),
        "per_batch_values": lambda: gather_in_order(
            [torch.zeros(2, 3)] * 2 if bad else torch.zeros(4, 3), torch.arange(4) + 4 * rank
        ),
        "str_indices": lambda: gather_in_order(torch.zeros(2), ["a", "b"] if bad else [2, 3]),
        "unpicklable_values": lambda: gather_in_order([(lambda: 0) if bad else 1], [rank]),
        "nested": lambda: sync_dicts({"t": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]) if bad else 1}),
        "nested_values": lambda: gather_in_order(
            torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]) if bad else torch.ones(2, 2),
            [2 * rank, 2 * rank + 1],
        ),
        "dict_values": lambda: gather_in_order({"a": 0, "b": 1} if bad else [0, 1], [2 * rank, 2 * rank + 1]),
        "failing_values": lambda: gather_in_order(_failing_values() if bad else [0, 1], [2 * rank, 2 * rank + 1]),
        "unprintable": lambda: gather_in_order(
            _failing_values(_Unprintable()) if bad else [0, 1], [2 * rank, 2 * rank + 1]
        ),
    }
    try:
        gather_in_order(_failing_values() if bad else [0, 1], [2 * rank, 2 * rank + 1])
    except RuntimeError as error:
        cause = type(error.__cause__).__name__ if error.__cause__ is not None else None
    alone = dist.new_group([0])  # every rank must create it; rank 1 is outside it
    return {
        "errors": {name: _error_of(call) for name, call in calls.items()},
        # Rank 0 calls sync_dicts where the others call gather_in_order: each raises in its function's words.
        "different_calls": _error_of(
            lambda: sync_dicts({"a": 1}) if bad else gather_in_order([0, 1], [2 * rank, 2 * rank + 1])
        ),
        # No rank is wrong alone: the ranks disagree. Rank 0 went on to its next collective before this was checked.
        "dataset_size_differs": _error_of(lambda: gather_in_order([0, 1], [2 * rank, 2 * rank + 1], 4 if bad else 3)),
        "after_errors": sync_dicts({"rank": rank}),
        "cause": cause,
        "outside_group": (
            _attempt(lambda: sync_dicts({"rank": [rank]}, group=alone)),
            _attempt(lambda: gather_in_order(torch.tensor([3.0, 2.0]), [1, 0], group=alone)),
            # rank 1 takes no part: its own two values are no dataset of 5 to check
            _attempt(lambda: gather_in_order(torch.tensor([3.0, 2.0]), [1, 0], dataset_size=2 + 3 * rank, group=alone)),
        ),
    }


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message")


def _failing_values(error: Optional[Exception] = None) -> Iterator[float]:
    """Per-sample values from a generator that fails half-way, with an exception of the user's own."""
    yield 0.0
    raise error or KeyError("no such sample")


def _cuda_gloo_worker(rank: int, world_size: int) -> Dict[str, Any]:
    out = sync_dicts({"x": torch.full((rank + 1, 2), float(rank), device="cuda:0"), "n": [rank]})
    return {"device": str(out["x"].device), "x": out["x"].cpu(), "n": out["n"]}


def _nccl_worker(rank: int, world_size: int) -> Dict[str, Any]:
    torch.cuda.set_device(rank)
    group = dist.new_group(backend="nccl")
    device = torch.device("cuda", rank)
    local = {
        "x": torch.full((rank + 1, 2), float(rank), device=device),
        "flags": torch.ones(rank, dtype=torch.bool, device=device),
        "seqs": [torch.arange(rank + 1, device=device)],
        "names": f"r{rank}",
    }
    out = sync_dicts(local, group=group)
    index = torch.arange(rank, 2 * world_size, world_size, device=device)
    ordered = gather_in_order(index.float(), index, dataset_size=2 * world_size, group=group)
    return {
        "devices": [str(out["x"].device), str(out["flags"].device), str(out["seqs"][0].device), str(ordered.device)],
        "x": out["x"].cpu(),
        "flags": out["flags"].cpu(),
        "seqs": [t.cpu() for t in out["seqs"]],
        "names": out["names"],
        "ordered": ordered.cpu(),
    }


# --- distributed tests ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def per_rank(request: pytest.FixtureRequest) -> List[Dict[str, Any]]:
    """Each rank's results from one real gloo run of :func:`_sync_worker`."""
    return run_distributed(_sync_worker, request.param)


def _assert_same(actual: Any, expected: Any, where: str = "result") -> None:
    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert torch.equal(actual, expected), f"{where}: values differ"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def test_every_rank_gets_the_merge_in_rank_order(per_rank: List[Dict[str, Any]]) -> None:
    expected = _expected_merge(len(per_rank))
    for rank, results in enumerate(per_rank):
        _assert_same(results["merged"], expected, f"rank {rank}")


def test_buffers_cut_into_concurrent_chunks_arrive_whole(per_rank: List[Dict[str, Any]]) -> None:
    expected = _expected_merge(len(per_rank))
    for rank, results in enumerate(per_rank):
        _assert_same(results["merged_in_chunks"], expected, f"rank {rank}")


def test_equal_sizes_on_every_rank(per_rank: List[Dict[str, Any]]) -> None:
    expected = torch.cat([_equal_rows(r) for r in range(len(per_rank))])
    for rank, results in enumerate(per_rank):
        _assert_same(results["equal_rows"], expected, f"rank {rank}")


def test_a_small_result_does_not_keep_the_received_buffer_alive(per_rank: List[Dict[str, Any]]) -> None:
    for results in per_rank:
        assert results["small_result_storage"] == 8 * 4 * len(per_rank)


def test_tensors_do_not_travel_as_pickles(per_rank: List[Dict[str, Any]]) -> None:
    big_tensor_bytes = _payload(0)["big"].numel() * 4
    for results in per_rank:
        assert not results["object_payload_has_tensor"]
        assert results["object_payload_bytes"] < big_tensor_bytes / 4


@pytest.mark.parametrize(
    "case, words",
    [
        ("keys", ["only_first", "only_rest"]),
        ("nested_keys", ["n.x", "n.y"]),
        ("trailing", ["'t'", "(3,)", "(4,)"]),
        ("dtype", ["'t'", "torch.float32", "torch.float64"]),
        ("kind", ["'t'", "tensor", "list"]),
        ("world_size", ["world_size=", "but the process group has"]),
    ],
)
def test_unmergeable_inputs_raise_on_every_rank(per_rank: List[Dict[str, Any]], case: str, words: List[str]) -> None:
    for rank, results in enumerate(per_rank):
        error = results["errors"][case]
        assert error is not None, f"rank {rank} did not raise for {case}"
        kind, message = error
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        for word in words:
            assert word in message, f"rank {rank}: {word!r} not in {message!r}"


def test_group_stays_usable_after_errors(per_rank: List[Dict[str, Any]]) -> None:
    for results in per_rank:
        assert results["after_errors"] == {"rank": list(range(len(per_rank)))}


def test_gather_in_order_drops_padding_and_sorts(per_rank: List[Dict[str, Any]]) -> None:
    world_size = len(per_rank)
    everything = torch.cat([_sampler_indices(r, world_size) for r in range(world_size)])
    assert len(everything) > DATASET, "the sampler must pad, or this test checks no duplicates"
    for results in per_rank:
        _assert_same(results["order_tensor"], _value_of(torch.arange(DATASET)))
        assert results["order_objects"] == [f"s{i}" for i in range(DATASET)]
        _assert_same(results["order_uneven"], _value_of(torch.arange(sum(ROWS[:world_size]))))


@pytest.mark.parametrize(
    "case, words",
    [
        ("missing", ["missing", "7", "8"]),
        ("out_of_range", ["range(6)", "6"]),
        ("conflict_tensor", ["different values"]),
        ("conflict_objects", ["different values"]),
        ("conflict_small", ["different values"]),
        ("empty_rank", ["values has shape", "(0,) torch.float32 on rank 0", "dim 0", "torch.empty((0, 2), dtype="]),
        ("empty_list", ["values is a list on rank 0, a tensor on rank 1", "torch.empty((0, 2), dtype=torch.float64)"]),
        ("dtype", ["values has shape", "torch.float32 on rank 0", "torch.float64 on rank 1"]),
    ],
)
def test_gather_in_order_errors(per_rank: List[Dict[str, Any]], case: str, words: List[str]) -> None:
    """Every rank raises in gather_in_order's words, never in those of sync_dicts it is built on."""
    everything = torch.cat([_sampler_indices(r, len(per_rank)) for r in range(len(per_rank))])
    values, counts = everything.unique(return_counts=True)
    repeated = set(values[counts > 1].tolist())
    for rank, results in enumerate(per_rank):
        error = results["order_errors"][case]
        assert error is not None, f"rank {rank} did not raise for {case}"
        kind, message = error
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        assert message.startswith("gather_in_order: ") and "sync_dicts" not in message, message
        for word in words:
            assert word in message, f"rank {rank}: {word!r} not in {message!r}"
        if case.startswith("conflict"):  # names exactly the repeated indices, whose copies sit on different ranks
            assert {int(i) for i in message.split(":")[-1].split(",")} == repeated, message


def test_gather_in_order_keeps_the_lowest_ranks_copy_of_a_rounded_repeat(per_rank: List[Dict[str, Any]]) -> None:
    expected = _first_copies(len(per_rank))
    assert not torch.equal(expected, _value_of(torch.arange(DATASET))), "no repeat differs: this test checks nothing"
    for rank, results in enumerate(per_rank):
        _assert_same(results["order_one_ulp"], expected, f"rank {rank}")


def test_gather_in_order_accepts_nan_repeats(per_rank: List[Dict[str, Any]]) -> None:
    expected = _value_of(torch.arange(DATASET))
    expected[:, 1] = math.nan
    for results in per_rank:
        assert isinstance(results["order_nan"], torch.Tensor), results["order_nan"]
        torch.testing.assert_close(results["order_nan"], expected, equal_nan=True, rtol=0, atol=0)


def test_gather_in_order_accepts_a_padded_sample_from_a_smaller_batch(per_rank: List[Dict[str, Any]]) -> None:
    locals_ = [results["linear_local"] for results in per_rank]
    index = torch.cat([_linear_embeddings(r, len(per_rank))[1] for r in range(len(per_rank))])
    embeddings = torch.cat(locals_)
    first = [int((index == i).nonzero()[0]) for i in range(LINEAR_SAMPLES)]  # the copy of the lowest rank
    # Where the kernels round both batch sizes alike, the repeat is bitwise equal and there is nothing to
    # tolerate; with torch 2.13 on x86 CPUs it was not (about 100 of the 128 elements differed in their last bit).
    for rank, results in enumerate(per_rank):
        _assert_same(results["linear"], embeddings[first], f"rank {rank}")
    copies = [(index == i).nonzero().flatten().tolist() for i in range(LINEAR_SAMPLES)]
    if all(torch.equal(embeddings[rows[0]], embeddings[row]) for rows in copies for row in rows[1:]):
        pytest.skip("order checked, but this machine's kernels round both batch sizes alike: no repeat to tolerate")


def test_conjugate_and_negative_views_travel_resolved(per_rank: List[Dict[str, Any]]) -> None:
    values = torch.cat([torch.tensor([1 + 2j, 3 - 4j]) * (r + 1) for r in range(len(per_rank))])
    expected = {"conj": values.conj().resolve_conj(), "neg": values.conj().imag.resolve_neg()}
    for rank, results in enumerate(per_rank):
        _assert_same(results["conj"], expected, f"rank {rank}")


def test_one_element_at_another_stride_travels(per_rank: List[Dict[str, Any]]) -> None:
    expected = {"x": torch.tensor([1.0 + 10 * r for r in range(len(per_rank))])}
    for rank, results in enumerate(per_rank):
        _assert_same(results["one_element_column"], expected, f"rank {rank}")


def test_every_rank_gets_the_keys_in_rank_0s_order(per_rank: List[Dict[str, Any]]) -> None:
    """Each rank's own order made a merge equal as a dict but iterated differently on odd ranks."""
    assert [results["key_order"] for results in per_rank] == [(["b", "a"], ["loss", "acc"])] * len(per_rank)


def test_keys_that_compare_equal_are_merged_whatever_their_repr(per_rank: List[Dict[str, Any]]) -> None:
    ranks = range(len(per_rank))
    for rank, results in enumerate(per_rank):
        merged = results["equal_keys"]
        assert isinstance(merged, dict), merged
        _assert_same(merged[1], torch.cat([torch.full((1, 2), r) for r in ranks]), f"rank {rank}[1]")
        _assert_same(merged[5], torch.cat([torch.full((1, 2), 10 + r) for r in ranks]), f"rank {rank}[5]")


@pytest.fixture(scope="module")
def lone_bad_calls() -> List[Dict[str, Any]]:
    """Each rank's results from :func:`_lone_bad_call_worker`; a rank left waiting fails it in 45 s, not 30 min."""
    return run_distributed(_lone_bad_call_worker, 2, timeout=45)


@pytest.mark.parametrize(
    "case, kind, words",
    [
        ("length", "ValueError", ["gather_in_order", "3 values", "2 indices"]),
        ("float_indices", "ValueError", ["gather_in_order", "1-D integer tensor", "torch.float32"]),
        ("zero_dim", "ValueError", ["gather_in_order", "0-dim"]),
        ("not_a_dict", "TypeError", ["sync_dicts", NOT_A_DICT]),
        ("sparse", "TypeError", ["sync_dicts", "dense", "sparse", "'t'"]),
        ("unpicklable", "TypeError", ["sync_dicts", "pickle", "'f'"]),
        ("world_size", "ValueError", ["world_size=3"]),
        ("none_index", "TypeError", ["gather_in_order", "indices must be a 1-D integer tensor", "NoneType"]),
        ("zero_world_size", "ValueError", ["world_size must be at least 1, got 0"]),
        ("str_world_size", "TypeError", ["world_size must be an int", "got str"]),
        ("float_dataset_size", "TypeError", ["gather_in_order: dataset_size must be an int", "got float"]),
        ("negative_dataset_size", "ValueError", ["gather_in_order: dataset_size must be in [0, 2**63)", "got -1"]),
        ("per_batch_indices", "ValueError", ["gather_in_order", "indices holds 2 batches", "torch.cat"]),
        ("per_batch_values", "ValueError", ["gather_in_order", "2 values but 4 indices", "torch.cat"]),
        ("str_indices", "TypeError", ["gather_in_order", "sequence of ints", "str at position 0"]),
        ("unpicklable_values", "TypeError", ["gather_in_order cannot pickle", "'values'"]),
        ("nested", "TypeError", ["sync_dicts can only send dense tensors", "nested", "'t'"]),
        ("nested_values", "RuntimeError", ["NestedTensor"]),  # torch's own words, on every rank
        ("dict_values", "TypeError", ["gather_in_order: values must be", "got dict"]),
        ("failing_values", "RuntimeError", ["KeyError: 'no such sample'"]),  # the type named, the message kept
        ("unprintable", "RuntimeError", ["_Unprintable: (its message could not be made)"]),  # still reaches rank 1
    ],
)
def test_one_ranks_bad_call_raises_on_every_rank(
    lone_bad_calls: List[Dict[str, Any]], case: str, kind: str, words: List[str]
) -> None:
    """A gather_in_order call's error is in its words, never in those of sync_dicts it is built on."""
    gathering = words[0].startswith("gather_in_order")
    for rank, results in enumerate(lone_bad_calls):
        error = results["errors"][case]
        assert error is not None, f"rank {rank} did not raise for {case}"
        assert error[0] == kind, f"rank {rank}: {error}"
        for word in ["rank 0:", *words]:
            assert word in error[1], f"rank {rank}: {word!r} not in {error[1]!r}"
        assert "rank 1" not in error[1], error[1]
        assert not (gathering and "sync_dicts" in error[1]), error[1]


def test_a_dataset_size_that_differs_between_ranks_raises_on_every_rank(lone_bad_calls: List[Dict[str, Any]]) -> None:
    for rank, results in enumerate(lone_bad_calls):
        assert results["dataset_size_differs"] == (
            "ValueError",
            "gather_in_order: dataset_size is 4 on rank 0, 3 on rank 1; pass the same dataset_size on every rank"
            " (the number of samples of the whole dataset, len(dataset)), or None on every rank",
        ), f"rank {rank}"


def test_ranks_calling_different_functions_raise_on_every_rank(lone_bad_calls: List[Dict[str, Any]]) -> None:
    kinds_and_words = [lone_bad_calls[0]["different_calls"], lone_bad_calls[1]["different_calls"]]
    assert kinds_and_words[0] is not None and "sync_dicts: ranks hold different keys" in kinds_and_words[0][1]
    assert kinds_and_words[1] == (
        "ValueError",
        "gather_in_order: rank(s) [0] made another call of lightning_ddp_ext.sync here (sync_dicts?); every rank must"
        " call the same functions in the same order",
    )


def test_group_stays_usable_after_one_ranks_bad_call(lone_bad_calls: List[Dict[str, Any]]) -> None:
    for results in lone_bad_calls:
        assert results["after_errors"] == {"rank": [0, 1]}


def test_a_rank_outside_the_group_gets_its_own_values(lone_bad_calls: List[Dict[str, Any]]) -> None:
    """As in torch's collectives, a rank that is not in ``group`` takes no part (torch's world size is -1 there)."""
    for rank, results in enumerate(lone_bad_calls):
        merged, ordered, checked = results["outside_group"]
        assert merged == {"rank": [rank]}, f"rank {rank}: {merged}"
        _assert_same(ordered, torch.tensor([2.0, 3.0]), f"rank {rank}")
        _assert_same(checked, torch.tensor([2.0, 3.0]), f"rank {rank}")


def test_the_failing_rank_keeps_its_error_as_the_cause(lone_bad_calls: List[Dict[str, Any]]) -> None:
    assert [results["cause"] for results in lone_bad_calls] == ["KeyError", None]


def test_per_sample_dicts_of_tensors_drop_their_padded_repeats(per_rank: List[Dict[str, Any]]) -> None:
    """A repeated index's two dicts are compared key by key, tensors within rounding (not with ``==``, which is
    no truth value for a tensor of several elements)."""
    for results in per_rank:
        ordered = results["order_dicts"]
        assert [sample["id"] for sample in ordered] == list(range(DATASET)), ordered
        _assert_same(torch.stack([sample["emb"] for sample in ordered]), _value_of(torch.arange(DATASET)))


def test_container_subclasses_without_tensors_keep_their_type(per_rank: List[Dict[str, Any]]) -> None:
    for results in per_rank:
        merged = results["unpicklable_subclass"]
        assert merged["x"] == [{"a": rank} for rank in range(len(per_rank))]
        assert [type(d) for d in merged["x"]] == [dict] * len(per_rank)
        assert [type(d) for d in merged["kept"]] == [OrderedDict] * len(per_rank)  # only what fails goes plain
        shapes, ordered_dicts = results["subclasses"]["shape"], results["subclasses"]["od"]
        assert [type(shape) for shape in shapes] == [torch.Size] * len(per_rank), shapes
        assert shapes == [torch.Size([2, rank]) for rank in range(len(per_rank))]
        assert [type(od) for od in ordered_dicts] == [OrderedDict] * len(per_rank), ordered_dicts
        assert [list(od) for od in ordered_dicts] == [["b", "a"]] * len(per_rank)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_over_gloo_come_back_on_cuda() -> None:
    for result in run_distributed(_cuda_gloo_worker, 2):
        assert result["device"] == "cuda:0"
        assert torch.equal(result["x"], torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
        assert result["n"] == [0, 1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices for NCCL")
def test_nccl_keeps_tensors_on_their_device() -> None:
    for rank, result in enumerate(run_distributed(_nccl_worker, 2)):
        assert result["devices"] == [f"cuda:{rank}"] * 4
        assert torch.equal(result["x"], torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
        assert torch.equal(result["flags"], torch.ones(1, dtype=torch.bool))
        assert [t.tolist() for t in result["seqs"]] == [[0], [0, 1]]
        assert result["names"] == ["r0", "r1"]
        assert torch.equal(result["ordered"], torch.arange(4.0))


# --- without a process group ---------------------------------------------------------------------------------------


@pytest.fixture()
def no_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")


@pytest.mark.usefixtures("no_process_group")
def test_sync_dicts_without_group_returns_its_input() -> None:
    d = _payload(0)
    assert sync_dicts(d) is d
    assert sync_dicts(d, world_size=1) is d


@pytest.mark.usefixtures("no_process_group")
@pytest.mark.parametrize("world_size", [None, 1])
def test_sync_dicts_without_group_rejects_a_non_dict(world_size: Optional[int]) -> None:
    """The error a group gives (see ``not_a_dict`` above), so the mistake shows before scaling up."""
    with pytest.raises(TypeError) as raised:
        sync_dicts([1], world_size=world_size)  # type: ignore[arg-type]
    assert str(raised.value) == NOT_A_DICT


def _sync_dicts_alone(rank: int, world_size: int) -> None:
    d = _payload(0)
    assert sync_dicts(d) is d
    with pytest.raises(ValueError, match="world_size=2"):
        sync_dicts(d, world_size=2)
    with pytest.raises(TypeError) as raised:
        sync_dicts([1])  # type: ignore[arg-type]
    assert str(raised.value) == NOT_A_DICT


def test_sync_dicts_in_a_group_of_one_returns_its_input() -> None:
    """In a rank of its own: a group made in the pytest process would have to be destroyed, which on torch < 2.8
    can deadlock holding the GIL (docs/compatibility.rst)."""
    run_distributed(_sync_dicts_alone, 1)


@dataclass
class _Prediction:
    embedding: torch.Tensor


@pytest.mark.usefixtures("no_process_group")
def test_gather_in_order_locally_compares_repeats_inside_containers() -> None:
    """Per-sample dicts, lists and tuples of tensors: repeats compared item by item (rounding allowed in tensors);
    an object whose ``==`` is no truth value gets an error that says what to pass instead."""
    rounded = torch.nextafter(torch.ones(3), torch.full((3,), 2.0))
    values = [{"emb": torch.ones(3), "id": 5}, ([torch.zeros(2)], 1), {"emb": rounded, "id": 5}, ([torch.zeros(2)], 1)]
    assert gather_in_order(values, [5, 1, 5, 1]) == [values[1], values[0]]
    with pytest.raises(ValueError, match="different values for the same index: 5"):
        gather_in_order([{"emb": torch.ones(3)}, {"emb": torch.zeros(3)}], [5, 5])
    with pytest.raises(ValueError, match="different values for the same index: 5"):
        gather_in_order([{"emb": torch.ones(3)}, {"emb": torch.ones(3), "id": 5}], [5, 5])
    with pytest.raises(TypeError, match="cannot compare two values of a repeated index .*_Prediction.*tensor"):
        gather_in_order([_Prediction(torch.ones(3)), _Prediction(torch.ones(3))], [5, 5])
    same_object = [math.nan, 1]
    assert gather_in_order([same_object, same_object], [0, 0]) == [same_object]  # itself, NaN and all
    losses = gather_in_order([{"loss": float("nan")}, {"loss": float("nan")}], [0, 0])  # two NaN objects
    assert len(losses) == 1 and math.isnan(losses[0]["loss"])
    objects = np.array([math.nan, "a", None], dtype=object)
    for nan_valued in (np.array([math.nan, 1.0]), np.array(math.nan), objects):
        assert len(gather_in_order([nan_valued, np.copy(nan_valued)], [0, 0])) == 1, nan_valued
    assert len(gather_in_order([complex(math.nan, 1), complex(math.nan, 1)], [0, 0])) == 1
    for other in (np.array([1.0, 2.0]), [1, 2], np.array([[1, 2]])):  # as tensors: dtype and shape must agree
        with pytest.raises(ValueError, match="different values for the same index: 0"):
            gather_in_order([np.array([1, 2]), other], [0, 0])
    holding_tensors = np.empty(2, dtype=object)
    holding_tensors[:] = [torch.ones(2), 1]
    structured = np.zeros(1, dtype=[("x", "f8"), ("o", "O")])
    structured["x"], structured["o"][0] = math.nan, torch.ones(3)
    wide, narrow = np.array([["abc", "de"], ["fghij", "k"]]), np.array([["abc", "de"]])  # <U5 and <U3 rows
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)  # numpy's advice against np.matrix
        matrix = np.matrix([[1, "a"]], dtype=object)  # ravel() of a matrix is a matrix: iterating it recursed
    for repeated in (holding_tensors, structured, matrix, structured[0]):  # [0]: a row, np.void
        assert len(gather_in_order([repeated, pickle.loads(pickle.dumps(repeated))], [0, 0])) == 1, repeated
    assert len(gather_in_order([wide[0], narrow[0]], [0, 0])) == 1  # the same strings, sliced from other batches
    assert gather_in_order([torch.Size([2]), (2,)], [0, 0]) == [torch.Size([2])]  # equal, as in Python
    assert gather_in_order({"b": 1, "a": 2}.keys(), [1, 0]) == ["a", "b"]  # ordered: a sequence of values


@pytest.mark.usefixtures("no_process_group")
@pytest.mark.parametrize("values", [{"emb": torch.zeros(2, 3), "y": torch.zeros(2)}, {"b", "a"}])
def test_gather_in_order_locally_refuses_dicts_and_sets(values: Any) -> None:
    """``list()`` of a dict is its keys, of a set an arbitrary order: neither is a sequence of per-sample values."""
    with pytest.raises(TypeError, match=f"values must be a tensor .* got {type(values).__name__}"):
        gather_in_order(values, [0, 1])


@pytest.mark.usefixtures("no_process_group")
def test_gather_in_order_locally_sorts_and_drops_repeats() -> None:
    index = torch.tensor([4, 1, 3, 0, 2, 4, 1])
    _assert_same(gather_in_order(_value_of(index), index, dataset_size=5), _value_of(torch.arange(5)))
    assert gather_in_order(["e", "b", "d", "a", "c", "e"], [4, 1, 3, 0, 2, 4]) == ["a", "b", "c", "d", "e"]
    assert gather_in_order([], [], dataset_size=0) == []


@pytest.mark.usefixtures("no_process_group")
@pytest.mark.parametrize(
    "values, indices, dataset_size, words",
    [
        (torch.tensor([1.0, 2.0, 3.0]), [0, 1, 0], None, ["different values", "0"]),
        ([{"a": 1}, {"a": 2}], [5, 5], None, ["different values", "5"]),
        ([torch.ones(2), torch.zeros(2)], [5, 5], None, ["different values", "5"]),
        (torch.arange(3.0), [0, 2, 3], 4, ["missing", "1"]),
        (torch.arange(12.0), list(range(12)), 25, ["13 of 25", "12, 13", "21", "and 3 more"]),
        (torch.arange(3.0), [0, 1, 2], 2, ["range(2)", "2"]),
        (torch.arange(2.0), [-1, 0], 2, ["range(2)", "-1"]),
        (torch.arange(3.0), [0, 1], None, ["3 values", "2 indices"]),
        (torch.arange(2.0), [0.0, 1.0], None, ["1-D integer tensor", "torch.float32"]),
        (torch.arange(4.0), [[0, 1], [2, 3]], None, ["indices holds 2 batches", "torch.cat"]),
        (torch.arange(2.0), [5, 2**70], None, ["1-D integer tensor", "does not fit in 64 bits"]),
        (torch.arange(4.0), torch.arange(4).reshape(2, 2), None, ["1-D integer tensor", "(2, 2)", "torch.cat"]),
        ([torch.zeros(2, 3)] * 2, [torch.arange(2), torch.arange(2, 4)], None, ["indices holds 2 batches"]),
        ([torch.zeros(2, 3)] * 2, torch.arange(4), None, ["2 values but 4 indices", "per-batch", "torch.cat"]),
    ],
)
def test_gather_in_order_locally_rejects_bad_input(
    values: Any, indices: Any, dataset_size: Optional[int], words: List[str]
) -> None:
    with pytest.raises(ValueError) as raised:
        gather_in_order(values, indices, dataset_size)
    assert str(raised.value).startswith("gather_in_order"), raised.value
    for word in words:
        assert word in str(raised.value), f"{word!r} not in {raised.value}"


@pytest.mark.usefixtures("no_process_group")
@pytest.mark.parametrize(
    "values, indices, words",
    [
        (torch.zeros(2), ["a", "b"], ["1-D integer tensor or sequence of ints", "str at position 0"]),
        (torch.zeros(2), [0, None], ["1-D integer tensor or sequence of ints", "NoneType at position 1"]),
        (torch.zeros(2), None, ["1-D integer tensor or sequence of ints", "NoneType"]),
        (None, [0, 1], ["values must be a tensor", "NoneType"]),
    ],
)
def test_gather_in_order_locally_rejects_what_holds_no_numbers(values: Any, indices: Any, words: List[str]) -> None:
    with pytest.raises(TypeError) as raised:
        gather_in_order(values, indices)
    assert str(raised.value).startswith("gather_in_order: "), raised.value
    for word in words:
        assert word in str(raised.value), f"{word!r} not in {raised.value}"


@pytest.mark.usefixtures("no_process_group")
def test_gather_in_order_locally_tolerates_rounding_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sync, "_tf32_allowed", lambda: False)  # float32 computed in float32 (see the TF32 test)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    up = torch.nextafter(x, torch.full_like(x, math.inf))
    _assert_same(gather_in_order(torch.cat([x, up]), [0, 1, 2, 0, 1, 2]), x)
    _assert_same(gather_in_order([x[0], up[0]], [4, 4])[0], x[0])  # per-sample tensors in a list
    nan = torch.tensor([[math.nan, 1.0], [math.nan, 1.0]])
    assert gather_in_order(nan, [0, 0]).isnan().sum() == 1
    with_nan = x[:1].clone()
    with_nan[0, 0] = math.nan
    for different in (x[:1] * (1 + 1e-3), with_nan, x[:1].to(torch.complex64) * 1j):
        with pytest.raises(ValueError, match="different values for the same index: 0"):
            gather_in_order(torch.cat([x[:1].to(different.dtype), different]), [0, 0])
    with pytest.raises(ValueError, match="different values"):
        gather_in_order([x[0], x[0].double()], [4, 4])  # another dtype is another value
    # Floating-point numpy arrays as tensors; Python floats exactly, with an error that says why
    _assert_same(torch.from_numpy(gather_in_order([x[0].numpy(), up[0].numpy()], [4, 4])[0]), x[0])
    with pytest.raises(ValueError, match="different values"):
        gather_in_order([x[0].numpy(), (x[0] * (1 + 1e-3)).numpy()], [4, 4])
    with pytest.raises(ValueError, match="its values hold Python floats, which are compared exactly.* not .tolist"):
        gather_in_order([x[0].tolist(), up[0].tolist()], [4, 4])
    # A 1-D numpy array's elements (numpy scalars) as arrays: they were compared exactly, with the hint above
    column, column_up = x[:, 0].numpy(), up[:, 0].numpy()
    assert gather_in_order(np.concatenate([column, column_up]), [0, 1, 2, 0, 1, 2]) == list(column)
    with pytest.raises(ValueError, match=r"different values for the same index: 0$"):
        gather_in_order(np.concatenate([column[:1], column[:1] * (1 + 1e-3)]), [0, 0])


@pytest.mark.usefixtures("no_process_group")
@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_gather_in_order_takes_the_unsigned_dtypes_torch_cannot_index_select(dtype: torch.dtype) -> None:
    """One token id or hash per sample in uint16/32/64 failed with torch's "index_select not implemented for
    'UInt64'" (rows of 2-D ones it can select)."""
    rows = torch.tensor([[20, 21], [0, 1], [10, 11], [0, 1], [2**15, 5]]).to(dtype)  # 2**15: negative as int16
    expected = torch.tensor([[0, 1], [10, 11], [20, 21], [2**15, 5]]).to(dtype)
    for values, kept in ((rows[:, 0].contiguous(), expected[:, 0].contiguous()), (rows, expected)):
        _assert_same(gather_in_order(values, [2, 0, 1, 0, 3]), kept)
        with pytest.raises(ValueError, match="different values for the same index: 0"):
            gather_in_order(values, [2, 0, 1, 3, 0])


@pytest.mark.usefixtures("no_process_group")
def test_numpy_index_arrays_are_taken_whole_whatever_their_integer_dtype() -> None:
    """A uint64 array (a numpy sampler's output) was refused as "an index does not fit in 64 bits"."""
    values = torch.tensor([10.0, 11.0, 12.0])
    for dtype in (np.uint64, np.uint8, np.int32, np.int64):
        _assert_same(gather_in_order(values, np.array([2, 0, 1], dtype=dtype)), torch.tensor([11.0, 12.0, 10.0]))
    _assert_same(gather_in_order(values, np.arange(6).reshape(3, 2)[:, 1] // 2), torch.tensor([10.0, 11.0, 12.0]))
    with pytest.raises(ValueError, match="an index does not fit in 64 bits"):
        gather_in_order(values[:1], np.array([2**63], dtype=np.uint64))
    with pytest.raises(ValueError, match="got dtype torch.float64"):
        gather_in_order(values, np.array([0.0, 1.0, 2.0]))


@pytest.mark.usefixtures("no_process_group")
@pytest.mark.parametrize("tf32", [False, True])
def test_float32_repeats_get_tf32_tolerance_where_cuda_may_compute_in_tf32(
    tf32: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU with TF32 (cuDNN's default, or set_float32_matmul_precision("high")), a padded sample computed in
    a batch of another size differed by 6e-4 of its magnitude: more than float32's sqrt(eps), 3.5e-4, so the
    default eval_mode="pad" failed every validation. A value of another sample still differs by far more."""
    monkeypatch.setattr(sync, "_tf32_allowed", lambda: tf32)
    x = torch.randn(1, 8, generator=torch.Generator().manual_seed(0))
    scale = x.abs().amax()  # the row's largest magnitude, to which the tolerance is relative
    rounded_in_tf32 = x + 6e-4 * scale
    for values, same in (
        (rounded_in_tf32, tf32),
        (x.to(torch.complex64) + 6e-4j * scale, tf32),
        (x + 0.1 * scale, False),
    ):
        pair = torch.cat([x.to(values.dtype), values])
        if same:
            _assert_same(gather_in_order(pair, [0, 0]), x.to(values.dtype))
        else:
            with pytest.raises(ValueError, match="different values for the same index: 0"):
                gather_in_order(pair, [0, 0])
    with pytest.raises(ValueError, match="different values"):  # float64 is never computed in TF32
        gather_in_order(torch.cat([x.double(), rounded_in_tf32.double()]), [0, 0])


@pytest.mark.usefixtures("no_process_group")
@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=40), st.randoms(use_true_random=False))
def test_gather_in_order_matches_sorted_unique(indices: List[int], random: Any) -> None:
    random.shuffle(indices)
    values = [f"v{i}" for i in indices]
    assert gather_in_order(values, indices) == [f"v{i}" for i in sorted(set(indices))]
    tensor_values = _value_of(torch.tensor(indices, dtype=torch.int64))
    _assert_same(gather_in_order(tensor_values, indices), _value_of(torch.tensor(sorted(set(indices)))))
