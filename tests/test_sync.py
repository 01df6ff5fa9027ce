"""Tests for lightning_ddp_ext.sync on real gloo process groups.

Spawning costs seconds, so each world size runs one worker that exercises every case and returns what it saw;
the test functions below only compare those results with expectations written out from the rules.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from distributed_helpers import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_ddp_ext import sync
from lightning_ddp_ext.sync import gather_in_order, sync_dicts

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


# --- the workers ---------------------------------------------------------------------------------------------------


def _error_of(call: Callable[[], Any]) -> Optional[Tuple[str, str]]:
    try:
        call()
    except Exception as error:  # reported to the parent, which checks type and message
        return type(error).__name__, str(error)
    return None


def _contains_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
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
    results["errors"] = {name: _error_of(lambda d=d: sync_dicts(d)) for name, d in _bad_inputs(rank).items()}
    results["errors"]["world_size"] = _error_of(lambda: sync_dicts({"a": 1}, world_size=world_size + 1))
    results["after_errors"] = sync_dicts({"rank": rank}, world_size=world_size)  # still in step after raising

    index = _sampler_indices(rank, world_size)
    results["order_tensor"] = gather_in_order(_value_of(index), index, dataset_size=DATASET)
    results["order_objects"] = gather_in_order([f"s{i}" for i in index.tolist()], index.tolist(), DATASET)
    start = sum(ROWS[:rank])
    uneven = torch.arange(start, start + ROWS[rank]).flip(0)  # reversed, and empty on rank 1
    results["order_uneven"] = gather_in_order(_value_of(uneven), uneven, dataset_size=sum(ROWS[:world_size]))
    results["order_errors"] = {
        "missing": _error_of(lambda: gather_in_order(_value_of(index), index, dataset_size=DATASET + 2)),
        "out_of_range": _error_of(lambda: gather_in_order(_value_of(index), index, dataset_size=DATASET - 1)),
        "conflict_tensor": _error_of(lambda: gather_in_order(_value_of(index) + rank, index)),
        "conflict_objects": _error_of(lambda: gather_in_order([(i, rank) for i in index.tolist()], index)),
    }
    return results


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
        ("world_size", ["world_size"]),
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
    ],
)
def test_gather_in_order_errors(per_rank: List[Dict[str, Any]], case: str, words: List[str]) -> None:
    everything = torch.cat([_sampler_indices(r, len(per_rank)) for r in range(len(per_rank))])
    values, counts = everything.unique(return_counts=True)
    repeated = set(values[counts > 1].tolist())
    for rank, results in enumerate(per_rank):
        error = results["order_errors"][case]
        assert error is not None, f"rank {rank} did not raise for {case}"
        kind, message = error
        assert kind == "ValueError", f"rank {rank}: {kind}: {message}"
        for word in words:
            assert word in message, f"rank {rank}: {word!r} not in {message!r}"
        if case.startswith("conflict"):  # names exactly the repeated indices, whose copies sit on different ranks
            assert {int(i) for i in message.split(":")[-1].split(",")} == repeated, message


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
def test_sync_dicts_in_a_group_of_one_returns_its_input(tmp_path: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        d = _payload(0)
        assert sync_dicts(d) is d
        with pytest.raises(ValueError, match="world_size=2"):
            sync_dicts(d, world_size=2)
    finally:
        dist.destroy_process_group()


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
        (torch.arange(2.0), [0.0, 1.0], None, ["integers"]),
    ],
)
def test_gather_in_order_locally_rejects_bad_input(
    values: Any, indices: Any, dataset_size: Optional[int], words: List[str]
) -> None:
    with pytest.raises(ValueError) as raised:
        gather_in_order(values, indices, dataset_size)
    for word in words:
        assert word in str(raised.value), f"{word!r} not in {raised.value}"


@pytest.mark.usefixtures("no_process_group")
@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=40), st.randoms(use_true_random=False))
def test_gather_in_order_matches_sorted_unique(indices: List[int], random: Any) -> None:
    random.shuffle(indices)
    values = [f"v{i}" for i in indices]
    assert gather_in_order(values, indices) == [f"v{i}" for i in sorted(set(indices))]
    tensor_values = _value_of(torch.tensor(indices, dtype=torch.int64))
    _assert_same(gather_in_order(tensor_values, indices), _value_of(torch.tensor(sorted(set(indices)))))
