"""CustomDDP with real lightning.pytorch.Trainer runs on 2 CPU processes.

Most runs are the calls of ``RANK_CALLS``, made one after another on two ranks started once for the module, as a
script run by torchrun makes several Trainers (``on_two_ranks``, see ``distributed_helpers.call_on_ranks``): each
test checks its call's outcome on every rank. One-device fits are the calls of ``ONE_PROCESS_CALLS``, made in one
new process (``in_one_process``, see ``distributed_helpers.call_in_a_new_process``). Runs about Lightning's launchers
(spawn, fork server, popen), or that leave a rank waiting for a launcher to end the job, start their own ranks.
"""
from __future__ import annotations

import functools
import os
import re
import warnings
from multiprocessing import forkserver
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import lightning
import lightning.pytorch as pl
import pytest
import torch
from distributed_helpers import (
    CallOutcomes, Outcome, RankCalls, call_in_a_new_process, run_python, shared_directory,
)
from lightning.pytorch.strategies import StrategyRegistry
from packaging.version import Version
from scenarios import (
    DATASET_SIZE,
    TEST_PG_TIMEOUT,
    ConstantLossOnRankOne,
    CountingDDP,
    DivergesAfter,
    IndexDataset,
    LengthBuckets,
    PKBatches,
    ALLREDUCE_ROUNDS,
    Recorder,
    counting_allreduce,
    labels_for,
    line_loader,
    loaders_by_kind,
    read_ranks,
    assert_raised,
    records,
    records_and_error,
    trainer_kwargs,
)
from torch.utils.data import DataLoader, TensorDataset

import lightning_ddp_ext
from lightning_ddp_ext import CustomDDP, _compat
from lightning_ddp_ext.dataloader import _patch as _patch_dataloader
from lightning_ddp_ext.dataloader import patch_dataloader_to_ddp
from lightning_ddp_ext.strategy import process_group_backend_for
from lightning_ddp_ext.sync import gather_in_order

HERE = Path(__file__).parent

# Every test that spawns ranks: a fresh port, a short process-group timeout for the strategies named by a
# string, and no rank left behind (tests that run no ranks pay only a look at /proc).
pytestmark = pytest.mark.usefixtures("spawn_job")

#: The runs made on the module's two ranks (see the module's docstring), filled in beside the tests that check them.
RANK_CALLS: RankCalls = {}
#: One-device fits, made one after another in one new process (``in_one_process``), filled in the same way.
ONE_PROCESS_CALLS: RankCalls = {}


def batches_of(rank_report: Dict[str, Any], key: str, epoch: int) -> List[List[int]]:
    return [indices for e, indices in rank_report["seen"][key] if e == epoch]


def _fit_every_kind() -> Dict[str, Any]:
    val = DataLoader(IndexDataset(), batch_sampler=PKBatches(labels_for(), p=2, k=4, seed=5))
    model = Recorder()
    pl.Trainer(strategy=CustomDDP(timeout=TEST_PG_TIMEOUT), **trainer_kwargs()).fit(model, loaders_by_kind(), val)
    return records(model)


RANK_CALLS["every kind"] = (_fit_every_kind, ())


def test_every_kind_of_custom_sampler_is_dealt_disjointly(on_two_ranks: CallOutcomes) -> None:
    """The four sampler kinds stock Lightning crashes on or silently duplicates, in one 2-epoch fit."""
    loaders = loaders_by_kind()
    ranks = on_two_ranks.returned("every kind")
    for name, loader in loaders.items():
        for epoch in range(2):
            user_sampler = loader.batch_sampler if name != "index_sampler" else None
            if user_sampler is not None and hasattr(user_sampler, "set_epoch"):
                user_sampler.set_epoch(epoch)
            if user_sampler is not None:
                expected = [list(b) for b in user_sampler]
            else:
                order = list(loader.sampler)
                expected = [order[i::2] for i in range(2)]  # index sampler: each rank takes every other index
            shares = [batches_of(ranks[r], f"train/{name}", epoch) for r in range(2)]
            assert len(shares[0]) == len(shares[1]) == 3, (name, epoch)
            if user_sampler is not None:
                assert shares[0] == expected[0::2] and shares[1] == expected[1::2], (name, epoch)
            else:
                assert [sum(share, []) for share in shares] == expected, (name, epoch)
            if name != "pk":  # these three partition the dataset; P x K draws samples with repeats by design
                seen = [i for share in shares for batch in share for i in batch]
                assert len(seen) == len(set(seen)) == DATASET_SIZE, f"{name}: ranks overlap or miss samples"
    # set_epoch reached the user's samplers from Lightning's loop, every epoch
    for report in ranks:
        assert report["facts"]["epochs_set"]["pk"] == [0, 1]
        assert report["facts"]["backend"] == "gloo"
    # validation is dealt too: 6 P x K batches, 3 per rank, disjoint
    val_seen = [batches_of(ranks[r], "val/only", 0) for r in range(2)]
    assert len(val_seen[0]) == len(val_seen[1]) == 3
    assert not {tuple(b) for b in val_seen[0]} & {tuple(b) for b in val_seen[1]}


def _count_allreduce_rounds(accumulate: int) -> Dict[str, Any]:
    ALLREDUCE_ROUNDS[0] = 0  # this process's count: earlier calls on these ranks may have counted too
    if accumulate == 4:  # the hook registered in a configure_ddp override
        strategy: CustomDDP = CountingDDP(timeout=TEST_PG_TIMEOUT)
    else:  # ddp_comm_hook= on gloo
        strategy = CustomDDP(timeout=TEST_PG_TIMEOUT, ddp_comm_hook=counting_allreduce)
    model = Recorder()
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(max_epochs=1, accumulate_grad_batches=accumulate))
    trainer.fit(model, DataLoader(IndexDataset(32), batch_size=1))  # 16 batches of 1 per rank
    return records(model)


RANK_CALLS.update({f"allreduce rounds, accumulate {n}": (_count_allreduce_rounds, (n,)) for n in (4, 1)})


def test_configure_ddp_override_and_one_allreduce_per_optimizer_step(on_two_ranks: CallOutcomes) -> None:
    """Counted by a comm hook: accumulate 4 -> 1 all-reduce round per optimizer step, not per micro-batch."""
    for accumulate in (4, 1):
        for outcome in on_two_ranks[f"allreduce rounds, accumulate {accumulate}"]:
            facts = outcome.returned()["facts"]
            assert facts["allreduce_rounds"] == 16 // accumulate, accumulate
            assert facts.get("configure_ddp_override_used") is (True if accumulate == 4 else None)


def _fit_unseeded() -> Dict[str, Any]:
    loader = DataLoader(IndexDataset(), batch_sampler=PKBatches(labels_for(), p=2, k=4, seed=None))
    model, trainer = Recorder(), pl.Trainer(strategy="ddp_custom_sampler", **trainer_kwargs(max_epochs=1))
    return records_and_error(model, lambda: trainer.fit(model, loader))


RANK_CALLS["unseeded"] = (_fit_unseeded, ())


def test_unseeded_sampler_fails_before_the_first_optimizer_step(on_two_ranks: CallOutcomes) -> None:
    for outcome in on_two_ranks["unseeded"]:
        result = outcome.returned()
        error = assert_raised(result, "does not produce the same sequence on every rank")
        assert "PKBatches" in error and "Seed the sampler" in error
        assert "train/only" not in result["seen"], "training went on with overlapping shares"


def _fit_diverging(same: int, shuffle_window: Optional[int], max_epochs: int) -> Dict[str, Any]:
    loader = DataLoader(IndexDataset(), batch_sampler=DivergesAfter(same=same, total=80))
    val = DataLoader(IndexDataset(), batch_sampler=DivergesAfter(same=80, total=80))  # consistent: no false alarm
    strategy = CustomDDP(
        timeout=TEST_PG_TIMEOUT, shuffle_batches_between_ranks=shuffle_window is not None, shuffle_window=shuffle_window
    )
    model, trainer = Recorder(), pl.Trainer(strategy=strategy, **trainer_kwargs(max_epochs=max_epochs))
    return records_and_error(model, lambda: trainer.fit(model, loader, val))


SHUFFLE_WINDOWS = [None, 1, 8]
RANK_CALLS.update({f"diverging in the head, window {w}": (_fit_diverging, (2, w, 1)) for w in SHUFFLE_WINDOWS})
RANK_CALLS.update({f"diverging after the head, {n} epochs": (_fit_diverging, (70, None, n)) for n in (1, 2)})


@pytest.mark.parametrize("shuffle_window", SHUFFLE_WINDOWS)
def test_a_sampler_diverging_inside_the_head_fails_before_the_first_optimizer_step(
    on_two_ranks: CallOutcomes, shuffle_window: Optional[int]
) -> None:
    """The ranks agree on the first round only: the first check compares the whole head (64 batches), which the
    wrapper reads before it yields its first batch, in order or shuffled within windows."""
    for outcome in on_two_ranks[f"diverging in the head, window {shuffle_window}"]:
        result = outcome.returned()
        assert_raised(result, "DivergesAfter does not produce the same sequence on every rank")
        assert "train/only" not in result["seen"], "training went on with overlapping shares"


@pytest.mark.parametrize("max_epochs", [1, 2])
def test_a_sampler_diverging_after_the_head_fails_at_the_end_of_its_epoch(
    on_two_ranks: CallOutcomes, max_epochs: int
) -> None:
    """Past the head, the digest samples the sequence; Lightning stops at the last batch (it knows the length),
    so the wrapper takes the epoch's digest when it deals its final block, and the next epoch's first step, or
    the end of training, compares it."""
    for outcome in on_two_ranks[f"diverging after the head, {max_epochs} epochs"]:
        result = outcome.returned()
        assert_raised(result, "the sequences it yielded in epoch 0 differ between rank 0 and rank 1")
        assert len(result["seen"]["train/only"]) == 40  # the whole of epoch 0, and not a step of epoch 1


def _fit_empty() -> None:
    loader = DataLoader(IndexDataset(), batch_sampler=PKBatches([], p=2, k=4))
    pl.Trainer(strategy="ddp_custom_sampler", **trainer_kwargs(max_epochs=1)).fit(Recorder(), loader)


RANK_CALLS["empty"] = (_fit_empty, ())


def test_empty_batch_sampler_is_a_clear_error(on_two_ranks: CallOutcomes) -> None:
    for outcome in on_two_ranks["empty"]:
        outcome.raised("PKBatches is empty")


def _fit_undealt() -> Dict[str, Any]:
    model = Recorder()
    trainer = pl.Trainer(strategy="ddp_custom_sampler", use_distributed_sampler=False, **trainer_kwargs(max_epochs=1))
    trainer.fit(model, DataLoader(IndexDataset(), batch_size=8))
    return records(model)


RANK_CALLS["use_distributed_sampler=False"] = (_fit_undealt, ())


def test_use_distributed_sampler_false_is_respected(on_two_ranks: CallOutcomes) -> None:
    ranks = on_two_ranks.returned("use_distributed_sampler=False")
    everything = [list(range(i, i + 8)) for i in range(0, DATASET_SIZE, 8)]
    assert batches_of(ranks[0], "train/only", 0) == batches_of(ranks[1], "train/only", 0) == everything


@pytest.mark.parametrize(
    "name,start_method,find_unused",
    [
        ("ddp_custom_sampler", "popen", False),
        ("ddp_custom_sampler_spawn", "spawn", False),
        ("ddp_custom_sampler_fork", "fork", False),
        ("ddp_custom_sampler_find_unused_parameters_true", "popen", True),
    ],
)
def test_registry_names_resolve(name: str, start_method: str, find_unused: bool) -> None:
    assert name in StrategyRegistry and "CustomDDP" in StrategyRegistry[name]["description"]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
    assert type(trainer.strategy) is CustomDDP
    assert trainer.strategy._start_method == start_method
    assert trainer.strategy.ddp_kwargs.get("find_unused_parameters", False) is find_unused


def test_register_is_idempotent() -> None:
    before = {name: dict(StrategyRegistry[name]) for name in lightning_ddp_ext.register()}
    assert lightning_ddp_ext.register() == list(before)
    assert {name: dict(StrategyRegistry[name]) for name in before} == before
    # A name the user registered again with options of their own, to the same class: register() overwrote it.
    # (Restored by hand: monkeypatch.setitem reads the old value with the registry's get, which builds a strategy.)
    try:
        StrategyRegistry.register("ddp_custom_sampler", CustomDDP, "mine", override=True, start_method="spawn", seed=5)
        lightning_ddp_ext.register()
        assert StrategyRegistry["ddp_custom_sampler"]["init_params"] == {"start_method": "spawn", "seed": 5}
    finally:
        dict.__setitem__(StrategyRegistry, "ddp_custom_sampler", before["ddp_custom_sampler"])


class NoReturnDDP(CustomDDP):
    """Lightning 1.x's DDPPlugin habit: assign the wrapper, return nothing."""

    def configure_ddp(self, model: torch.nn.Module, device_ids: Optional[List[int]]) -> Any:  # type: ignore[override]
        self.model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


class TwoXStyleDDP(CustomDDP):
    """Lightning 2.x's own DDPStrategy.configure_ddp signature."""

    def configure_ddp(self) -> None:  # type: ignore[override]
        self.model = torch.nn.parallel.DistributedDataParallel(self.model)


def _fit_two_steps_with(strategy_class: type) -> int:
    """One device, one epoch of two batches under ``strategy_class()``; the Trainer's step count."""
    trainer = pl.Trainer(strategy=strategy_class(), **trainer_kwargs(devices=1, max_epochs=1))
    trainer.fit(OrderRecorder(), DataLoader(TensorDataset(torch.ones(4, 1)), batch_size=2))
    return trainer.global_step


@pytest.mark.parametrize(
    "strategy_class, words",
    [(NoReturnDDP, "returned NoneType, not the wrapped model"), (TwoXStyleDDP, "must take (self, model, device_ids)")],
)
def test_a_configure_ddp_that_does_not_return_the_wrapper_is_refused(
    in_one_process: Dict[str, Outcome], strategy_class: type, words: str
) -> None:
    """Without the check, NoReturnDDP trained with no gradient sync at all (Lightning's model getter falls back to
    the bare module) and TwoXStyleDDP failed with "takes 1 positional argument but 3 were given"."""
    expected = [words, "return DistributedDataParallel(model, device_ids=device_ids"]
    outcome = in_one_process[f"two steps, {strategy_class.__name__}"]
    outcome.raised("TypeError: .*" + ".*".join(map(re.escape, expected)))


def _adapted_from_two_x(configure_ddp: Any) -> Any:
    """A decorator that adapts a Lightning 2.x-style ``configure_ddp(self)`` to ours, keeping its name (``wraps``)."""

    @functools.wraps(configure_ddp)
    def adapted(self: CustomDDP, model: torch.nn.Module, device_ids: Optional[List[int]]) -> torch.nn.Module:
        configure_ddp(self)
        return self.model  # type: ignore[return-value]

    return adapted


class AdaptedDDP(CustomDDP):
    @_adapted_from_two_x
    def configure_ddp(self) -> None:  # type: ignore[override]
        self.model = torch.nn.parallel.DistributedDataParallel(self.model)


class UnwrappedOnOneRankDDP(CustomDDP):
    """Returns the model itself: nothing to synchronise in a world of one (on more ranks it warns)."""

    def configure_ddp(  # type: ignore[override]
        self, model: torch.nn.Module, device_ids: Optional[List[int]]
    ) -> torch.nn.Module:
        return model


@pytest.mark.parametrize("strategy_class", [AdaptedDDP, UnwrappedOnOneRankDDP])
def test_configure_ddp_overrides_that_return_a_module_are_accepted(
    in_one_process: Dict[str, Outcome], strategy_class: type
) -> None:
    """The signature checked is that of what is called (a decorator's wrapper), and the model itself is a module."""
    assert in_one_process[f"two steps, {strategy_class.__name__}"].returned() == 2


def test_a_one_device_fit_in_the_pytest_process_is_refused_before_it_makes_a_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """conftest.py's guard reaches the strategy's own init_process_group: a group made here would have to be
    destroyed here, which can deadlock on torch < 2.8 (see distributed_helpers.call_in_a_new_process)."""
    # Lightning's launcher exports these before the group; LOCAL_RANK left set told later popen launches in this
    # process "the ranks were started for you" (a docs example then waited for a rank 1 that never came).
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "OMP_NUM_THREADS"):
        monkeypatch.setenv(name, "0")  # registers the original value, or its absence, for restoring
        monkeypatch.delenv(name)
    trainer = pl.Trainer(strategy=CustomDDP(), **trainer_kwargs(devices=1, max_epochs=1))
    with pytest.raises(RuntimeError, match="a test tried to make a process group in the pytest process"):
        trainer.fit(OrderRecorder(), DataLoader(TensorDataset(torch.ones(4, 1)), batch_size=2))
    assert not torch.distributed.is_initialized()


class NoGroupDDP(CustomDDP):
    """An init_ddp_connection override that forgets to initialise the process group."""

    def init_ddp_connection(self, global_rank: Optional[int] = None, world_size: Optional[int] = None) -> None:
        pass


class OneXConnectionDDP(CustomDDP):
    """A Lightning 1.x DDPPlugin override body: super() called without arguments (both were optional there)."""

    def init_ddp_connection(self, global_rank: Optional[int] = None, world_size: Optional[int] = None) -> None:
        self.connected_as = (self.global_rank, self.world_size)
        super().init_ddp_connection()


ONE_PROCESS_CALLS.update(
    {
        f"two steps, {strategy_class.__name__}": (_fit_two_steps_with, (strategy_class,))
        for strategy_class in (NoReturnDDP, TwoXStyleDDP, AdaptedDDP, UnwrappedOnOneRankDDP, OneXConnectionDDP)
    }
)


def test_init_ddp_connection_takes_1x_calls_and_must_leave_a_process_group(in_one_process: Dict[str, Outcome]) -> None:
    """super().init_ddp_connection() with no arguments (1.x's signature) failed with "missing 2 required positional
    arguments"; an override that left no group failed later with torch's "Default process group has not been
    initialized", naming no hook. That one needs a process where no group was made yet: a new one of its own."""
    assert in_one_process["two steps, OneXConnectionDDP"].returned() == 2
    [outcome] = call_in_a_new_process({"no group": (_fit_two_steps_with, (NoGroupDDP,))}).values()
    outcome.raised("RuntimeError: NoGroupDDP.init_ddp_connection returned without a default process group")


def test_more_processes_per_node_than_devices_is_refused_before_the_process_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun --nnodes=1 --nproc_per_node=2 with Trainer(num_nodes=2, devices=1): the world size matches, so
    Lightning accepted it, and local rank 1 failed with an IndexError in DDPStrategy.root_device."""
    environment = {"TORCHELASTIC_RUN_ID": "test", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                   "GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    trainer = pl.Trainer(strategy=CustomDDP(), **trainer_kwargs(devices=1, num_nodes=2, max_epochs=1))
    with pytest.raises(RuntimeError) as raised:
        trainer.fit(OrderRecorder(), DataLoader(TensorDataset(torch.ones(4, 1)), batch_size=2))
    assert "this process is local rank 1 of its node, but Trainer(devices=1) runs 1 process(es) per node" in str(
        raised.value
    ), str(raised.value)
    assert "torchrun's --nproc_per_node (or srun's --ntasks-per-node) equal Trainer(devices=...)" in str(raised.value)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"find_unused_paramters": True}, "unexpected keyword argument 'find_unused_paramters'. Did you mean"
         " 'find_unused_parameters'?"),
        ({"start_methd": "spawn"}, "unexpected keyword argument 'start_methd'. Did you mean 'start_method'?"),
        ({"device_ids": [0]}, "got device_ids=..., which the strategy sets itself"),
    ],
)
def test_keywords_the_model_wrapper_does_not_take_are_refused_at_construction(
    kwargs: Dict[str, Any], words: str
) -> None:
    """Before launch, not when each rank wraps its model; an override of configure_ddp may take its own."""
    with pytest.raises(TypeError) as raised:
        CustomDDP(**kwargs)
    assert words in str(raised.value), str(raised.value)
    UnwrappedOnOneRankDDP(find_unused_paramters=True)  # its configure_ddp decides what its keywords mean
    CustomDDP(find_unused_parameters=True, static_graph=True, bucket_cap_mb=10, gradient_as_bucket_view=True)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"timeout": 1800}, TypeError, "CustomDDP(timeout=1800): the process-group timeout must be a datetime."
         "timedelta, for example timeout=timedelta(seconds=1800)"),
        ({"timeout": "30m"}, TypeError, "for example timeout=timedelta(minutes=30)"),
        ({"process_group_backend": "glo"}, ValueError, "knows no backend 'glo'. Known: 'gloo', 'nccl'"),
        ({"process_group_backend": "cpu:gloo,cuda:ncl"}, ValueError, "knows no backend 'ncl'"),
        ({"process_group_backend": torch.device("cpu")}, TypeError, "give the backend's name as a string"),
        # Both failed in every rank after launch: a socket timed out "after 0ms", torch's "Unknown c10d backend type"
        ({"timeout": __import__("datetime").timedelta(0)}, ValueError, "the process-group timeout must be positive"),
        ({"process_group_backend": "gloo,nccl"}, ValueError, "one per device, as 'device:backend' pairs"),
    ],
)
def test_a_bad_timeout_or_backend_is_refused_at_construction(
    kwargs: Dict[str, Any], error: type, words: str
) -> None:
    """Lightning hands both to init_process_group unchecked: they failed in every rank after launch, an unknown
    backend with an AssertionError that lists nothing."""
    with pytest.raises(error) as raised:
        CustomDDP(**kwargs)
    assert words in str(raised.value), str(raised.value)


def test_timeouts_and_backends_torch_takes_are_accepted() -> None:
    """Per-device backend strings, any case, a registered third-party backend (it registers for this process)."""
    from datetime import timedelta

    if "lddpext_test" not in torch.distributed.Backend.backend_list:
        torch.distributed.Backend.register_backend("lddpext_test", lambda *args: None, devices=["cpu"])
    for backend in ("gloo", "GLOO", "cpu:gloo,cuda:nccl", "lddpext_test"):
        strategy = CustomDDP(parallel_devices=[torch.device("cpu")], process_group_backend=backend)
        assert strategy.select_process_group_backend() == backend
    CustomDDP(timeout=timedelta(seconds=5))
    CustomDDP(timeout=None)


def test_returning_the_model_itself_on_several_ranks_warns() -> None:
    """It may synchronise by itself (torch's composable replicate()), so a warning, not an error."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    strategy = UnwrappedOnOneRankDDP(cluster_environment=LightningEnvironment())
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.set_world_ranks()
    strategy.model = torch.nn.Linear(1, 1)
    with pytest.warns(UserWarning, match="returned the model itself: gradients are synchronised only if"):
        strategy._wrap_lightning_model()


def test_a_subclass_registers_names_of_its_own_only() -> None:
    """Stock Lightning raises when a subclass re-registers its parent's names; so do we, instead of taking
    "ddp_custom_sampler" over silently (and never registering the subclass's own name)."""

    class Inheriting(CustomDDP):
        strategy_name = "my_ddp"

    class OwnNames(CustomDDP):
        registry_entries = (("my_ddp_for_this_test", {"start_method": "spawn"}),)

    class Taking(CustomDDP):
        registry_entries = (("ddp_custom_sampler", {"start_method": "popen"}),)

    with pytest.raises(ValueError, match="under its parent's names .*'ddp_custom_sampler'.* registry_entries"):
        Inheriting.register_strategies(StrategyRegistry)
    with pytest.raises(ValueError, match="registered to other classes: {'ddp_custom_sampler': 'CustomDDP'}.*remove"):
        Taking.register_strategies(StrategyRegistry)
    assert StrategyRegistry["ddp_custom_sampler"]["strategy"] is CustomDDP
    OwnNames.register_strategies(StrategyRegistry)
    try:
        assert StrategyRegistry["my_ddp_for_this_test"]["strategy"] is OwnNames
        OwnNames.register_strategies(StrategyRegistry)  # again: left alone
    finally:
        StrategyRegistry.remove("my_ddp_for_this_test")


def test_backend_selection() -> None:
    assert process_group_backend_for(torch.device("cpu")) == "gloo"
    assert process_group_backend_for(torch.device("cuda", 1)) == "nccl"
    assert process_group_backend_for(torch.device("cuda", 0), "gloo") == "gloo"
    on_gpu = CustomDDP(parallel_devices=[torch.device("cuda", 0), torch.device("cuda", 1)])
    assert on_gpu.select_process_group_backend() == "nccl"
    assert CustomDDP(parallel_devices=[torch.device("cpu")]).select_process_group_backend() == "gloo"
    forced = CustomDDP(parallel_devices=[torch.device("cuda", 0)], process_group_backend="gloo")
    assert forced.select_process_group_backend() == "gloo"
    # Given, it is known before the Trainer sets the devices (an empty AssertionError from root_device before)
    assert CustomDDP(process_group_backend="gloo").select_process_group_backend() == "gloo"


def test_get_model_from_plugin_unwraps_nested_wrappers() -> None:
    module = Recorder("unused")

    class Outer(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.module = inner

    assert CustomDDP().get_model_from_plugin(Outer(Outer(module))) is module
    with pytest.raises(TypeError, match="does not wrap a LightningModule"):
        CustomDDP().get_model_from_plugin(torch.nn.Linear(1, 1))


def test_popen_launcher_from_a_standalone_script(tmp_path: Path) -> None:
    """The plain "ddp_custom_sampler" name re-runs sys.argv per rank, so it runs as a script."""
    run_python(str(HERE / "scripts" / "popen_fit.py"), str(tmp_path), timeout=240, cwd=tmp_path)
    ranks = read_ranks(str(tmp_path), 2)
    expected = list(PKBatches(labels_for(), p=2, k=4, seed=1))  # the script's sampler, epoch 0
    assert [batches_of(ranks[r], "train/only", 0) for r in range(2)] == [expected[0::2], expected[1::2]]


def test_a_fit_after_lr_find_trains_the_samplers_first_epoch_first(tmp_path: Path) -> None:
    """lr_find's loop, longer than an epoch, leaves the user's sampler at epoch 1 in the same processes; the
    fit's loader workers draw as soon as its iterator is made, before the loop's set_epoch(0): the fit trained
    epoch 1's order twice (stock "ddp" too). The strategy sets the sampler back to epoch 0 first."""
    run_python(str(HERE / "scripts" / "popen_fit.py"), str(tmp_path), "lr_find", timeout=300, cwd=tmp_path)
    ranks = read_ranks(str(tmp_path), 2)
    sampler = PKBatches(labels_for(), p=2, k=4, seed=1)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        expected = list(sampler)
        assert [batches_of(ranks[r], "train/only", epoch) for r in range(2)] == [expected[0::2], expected[1::2]]


class Predictor(Recorder):
    def predict_step(self, batch: Any, batch_idx: int) -> None:
        self._record("predict", batch)

    def on_predict_end(self) -> None:
        self.teardown("predict")


def _predict_plainly() -> Dict[str, Any]:
    model, trainer = Predictor(), pl.Trainer(strategy="ddp_custom_sampler", **trainer_kwargs())
    trainer.predict(model, DataLoader(IndexDataset(), batch_size=8), return_predictions=False)
    return records(model)


RANK_CALLS["predict"] = (_predict_plainly, ())


def test_predict_is_sharded_by_lightning(on_two_ranks: CallOutcomes) -> None:
    """Predict loaders are left to Lightning, which splits them across ranks without padding."""
    ranks = on_two_ranks.returned("predict")
    seen = [i for report in ranks for _, batch in report["seen"]["predict/only"] for i in batch]
    assert sorted(seen) == list(range(DATASET_SIZE))


class SelfShardingPredictor(Predictor):
    """Deals a custom batch sampler in predict_dataloader and gathers the predictions in dataset order, as
    docs/guides/evaluation.rst shows (outputs kept on the module: under the spawn and fork launchers Lightning
    keeps no ``predict_loop.predictions``)."""

    def on_predict_epoch_start(self) -> None:
        self.outputs: List[Any] = []

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        super().predict_step(batch, batch_idx)
        x, index = batch
        value = torch.cat([x, index.unsqueeze(1).float()], dim=1)  # carries its index, so the order shows
        self.outputs.append((value, index))
        return value

    def on_predict_epoch_end(self) -> None:
        values = torch.cat([value for value, _ in self.outputs])
        indices = torch.cat([index for _, index in self.outputs])
        self.facts["gathered"] = gather_in_order(values, indices, dataset_size=DATASET_SIZE)[:, 1].tolist()

    loader_kind = "batch_sampler"

    def predict_dataloader(self) -> DataLoader:
        if self.loader_kind == "batch_sampler":
            batches = [list(range(start, min(start + 5, DATASET_SIZE))) for start in range(0, DATASET_SIZE, 5)]
            loader = DataLoader(IndexDataset(), batch_sampler=batches)
        elif self.loader_kind == "index_sampler":
            loader = DataLoader(IndexDataset(), batch_size=5, sampler=list(reversed(range(DATASET_SIZE))))
        else:
            loader = DataLoader(IndexDataset(), batch_size=5)
        return patch_dataloader_to_ddp(loader, even_shares=False)


def _predict_self_sharded(loader_kind: str) -> Dict[str, Any]:
    model, trainer = SelfShardingPredictor(), pl.Trainer(strategy="ddp_custom_sampler", **trainer_kwargs())
    model.loader_kind = loader_kind
    trainer.predict(model, return_predictions=False)
    return records(model)


LOADER_KINDS = ["batch_sampler", "index_sampler", "batch_size"]
RANK_CALLS.update({f"predict self-sharded, {kind}": (_predict_self_sharded, (kind,)) for kind in LOADER_KINDS})


@pytest.mark.parametrize("loader_kind", LOADER_KINDS)
def test_a_loader_sharded_in_predict_dataloader_predicts_each_sample_once(
    on_two_ranks: CallOutcomes, loader_kind: str
) -> None:
    """Lightning does not deal custom batch samplers in predict; the documented recipe does, unpadded. A loader
    our wrapper deals already is not sharded a second time by Lightning (it would skip half of each share)."""
    if loader_kind == "batch_sampler" and Version(lightning.__version__) < Version("2.3"):
        pytest.skip("Lightning before 2.3 refuses, in predict, any batch sampler that does not subclass BatchSampler")
    ranks = on_two_ranks.returned(f"predict self-sharded, {loader_kind}")
    shares = [[i for _, batch in report["seen"]["predict/only"] for i in batch] for report in ranks]
    assert sorted(shares[0] + shares[1]) == list(range(DATASET_SIZE)) and all(shares)
    assert [report["facts"]["gathered"] for report in ranks] == [list(map(float, range(DATASET_SIZE)))] * 2


class KeyedLoader(DataLoader):
    """A DataLoader subclass with an argument of its own, whose batches come wrapped in a dict under that key."""

    def __init__(self, dataset: Any, key: str, batch_size: Optional[int] = 1, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=batch_size, **kwargs)
        self.key = key

    def __iter__(self) -> Iterator[Dict[str, Any]]:  # type: ignore[override]
        for batch in super().__iter__():
            yield {self.key: batch}


class SubclassLoaders(Recorder):
    """Both loaders are KeyedLoaders made in hooks (so Lightning records their arguments), one positionally."""

    def train_dataloader(self) -> DataLoader:
        return KeyedLoader(
            IndexDataset(), "tk", batch_sampler=LengthBuckets([(i * 5) % 13 for i in range(DATASET_SIZE)], 8)
        )

    def val_dataloader(self) -> DataLoader:
        return KeyedLoader(IndexDataset(), "vk", 8)


def _fit_subclass_loaders() -> Dict[str, Any]:
    model = SubclassLoaders()
    pl.Trainer(strategy="ddp_custom_sampler", **trainer_kwargs(max_epochs=1)).fit(model)
    return records(model)


RANK_CALLS["subclass loaders"] = (_fit_subclass_loaders, ())


def test_dataloader_subclass_keeps_its_class(on_two_ranks: CallOutcomes) -> None:
    """A DataLoader subclass is rebuilt as itself around the sharded (batch) sampler, not as a plain DataLoader."""
    ranks = on_two_ranks.returned("subclass loaders")
    expected = [list(b) for b in LengthBuckets([(i * 5) % 13 for i in range(DATASET_SIZE)], 8)]
    assert [batches_of(ranks[r], "train/tk", 0) for r in range(2)] == [expected[0::2], expected[1::2]]
    val = [i for r in range(2) for batch in batches_of(ranks[r], "val/vk", 0) for i in batch]
    assert sorted(val) == list(range(DATASET_SIZE))  # the dict came from KeyedLoader.__iter__, sharded


def test_dataloader_subclass_is_rebuilt_from_its_attributes() -> None:
    """A loader made outside any hook: its arguments are read from its attributes, as Lightning does."""
    loader = KeyedLoader(IndexDataset(8), "k", batch_size=2)
    rebuilt = _compat.rebuild_dataloader(loader, _patch_dataloader(loader, 2, 1, {}, keep_class=False))
    assert type(rebuilt) is KeyedLoader
    assert [batch["k"][1].tolist() for batch in rebuilt] == [[1, 3], [5, 7]]


class FixedLoader(DataLoader):
    def __init__(self, dataset: Any) -> None:  # no way to pass a sampler on
        super().__init__(dataset, batch_size=4)


def test_dataloader_subclass_that_cannot_be_rebuilt_is_a_clear_error() -> None:
    loader = FixedLoader(IndexDataset(8))
    with pytest.raises(TypeError, match=r"FixedLoader is a DataLoader subclass.*\(\*\*kwargs is enough\)"):
        _compat.rebuild_dataloader(loader, _patch_dataloader(loader, 2, 0, {}, keep_class=False))  # as CustomDDP does


class SamplerKwargsDDP(CustomDDP):
    """Extends the overridable hook the way Lightning subclasses do."""

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        return {**super().distributed_sampler_kwargs, "shuffle": True, "drop_last": True, "seed": 7}


def test_sampler_kwargs_that_lightning_cannot_take_are_explained_before_predict(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Lightning shards predict loaders with this dict as torch's sampler arguments and fails on our keys with
    "got multiple values for argument 'shuffle'". A warning says why first (a warning, not an error: a predict
    loader Lightning does not shard, over an IterableDataset, works with the same override)."""
    trainer = pl.Trainer(strategy=SamplerKwargsDDP(start_method="spawn", timeout=TEST_PG_TIMEOUT), **trainer_kwargs())
    with pytest.raises(Exception, match="multiple values for argument 'shuffle'"):
        trainer.predict(Predictor(str(tmp_path)), DataLoader(IndexDataset(), batch_size=8), return_predictions=False)
    assert "returned ['shuffle'] during predict" in capfd.readouterr().err


def test_distributed_sampler_kwargs_override_merges_with_the_options() -> None:
    strategy = SamplerKwargsDDP(parallel_devices=[torch.device("cpu")] * 2, pad_to_world_size=True, seed=1)
    training = strategy.sharding_options(training=True)
    assert training == {
        "num_replicas": 2, "rank": 0, "shuffle": True, "shuffle_window": None, "seed": 7, "pad": False,
        "even_shares": True,
    }  # the hook's keys win over the constructor's
    evaluation = strategy.sharding_options(training=False)
    assert evaluation["shuffle"] is False and evaluation["pad"] is True  # evaluation keeps what eval_mode needs
    batches = patch_dataloader_to_ddp(DataLoader(IndexDataset(7), batch_sampler=[[i] for i in range(7)]), **training)
    assert len(batches) == 3  # drop_last=True: the incomplete round is dropped

    class Unknown(CustomDDP):
        @property
        def distributed_sampler_kwargs(self) -> Dict[str, Any]:
            return {**super().distributed_sampler_kwargs, "prefetch": 2}

    with pytest.raises(TypeError, match=r"returned \['prefetch'\], which this strategy does not use"):
        Unknown(parallel_devices=[torch.device("cpu")] * 2).sharding_options(training=True)

    class Contradicting(CustomDDP):
        @property
        def distributed_sampler_kwargs(self) -> Dict[str, Any]:
            return {**super().distributed_sampler_kwargs, "pad": True, "drop_last": True}

    with pytest.raises(ValueError, match="pad=True and drop_last=True, which disagree"):
        Contradicting(parallel_devices=[torch.device("cpu")] * 2).sharding_options(training=True)


class Reloading(Recorder):
    """Builds new samplers at every reload and records how many wrappers the strategy compares."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexDataset(), batch_sampler=PKBatches(labels_for(), p=2, k=4, seed=0))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexDataset(), batch_sampler=PKBatches(labels_for(), p=2, k=4, seed=1))

    def on_train_epoch_end(self) -> None:
        watched = self.trainer.strategy._watched  # type: ignore[attr-defined]
        self.facts.setdefault("watched", []).append([len(watched.get("train", [])), len(watched.get("eval", []))])
        user_sampler = self.trainer.train_dataloader.batch_sampler.batch_sampler  # type: ignore[union-attr]
        self.facts.setdefault("epochs_given", []).append(user_sampler.epochs_set)


def _fit_reloading() -> Dict[str, Any]:
    model = Reloading()
    options = trainer_kwargs(max_epochs=3, reload_dataloaders_every_n_epochs=1)
    pl.Trainer(strategy="ddp_custom_sampler", **options).fit(model)
    return records(model)


RANK_CALLS["reloading"] = (_fit_reloading, ())


def test_reloaded_loaders_replace_the_watched_wrappers(on_two_ranks: CallOutcomes) -> None:
    """reload_dataloaders_every_n_epochs=1 with new samplers each time: the wrappers checked do not pile up, and
    each sampler is given its epoch once."""
    for outcome in on_two_ranks["reloading"]:
        report = outcome.returned()
        assert report["facts"]["watched"] == [[1, 1]] * 3
        # Each new sampler is given its epoch once (the strategy sets it first, then Lightning's loop): a sampler
        # whose set_epoch advances a curriculum must not advance twice.
        assert report["facts"]["epochs_given"] == [[0], [1], [2]]


class CurriculumBatches:
    """Four batches of two from the first ``limit`` indices (the easy samples); a callback raises ``limit``."""

    def __init__(self) -> None:
        self.limit = 4

    def __len__(self) -> int:
        return 4

    def __iter__(self) -> Iterator[List[int]]:
        return iter([[(2 * i) % self.limit, (2 * i + 1) % self.limit] for i in range(4)])


class RaiseTheLimit(pl.Callback):
    """Written as on one device, where the loader holds the user's batch sampler itself."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.train_dataloader.batch_sampler.limit = 4 * (trainer.current_epoch + 1)  # type: ignore[union-attr]


def _fit_raising_the_limit() -> Dict[str, Any]:
    model = Recorder()
    trainer = pl.Trainer(strategy="ddp_custom_sampler", callbacks=[RaiseTheLimit()], **trainer_kwargs())
    trainer.fit(model, DataLoader(IndexDataset(), batch_sampler=CurriculumBatches()))
    return records(model)


RANK_CALLS["raising the limit"] = (_fit_raising_the_limit, ())


def test_a_callback_setting_the_batch_samplers_attribute_reaches_the_users_sampler(on_two_ranks: CallOutcomes) -> None:
    """Set on the wrapper, ``limit`` would change nothing, silently: it is the user's sampler's, set through."""
    ranks = on_two_ranks.returned("raising the limit")
    for epoch, expected in ((0, range(4)), (1, range(8))):
        seen = {i for r in range(2) for batch in batches_of(ranks[r], "train/only", epoch) for i in batch}
        assert seen == set(expected), f"epoch {epoch}"


class IntegerMeanInStep(pl.LightningModule):
    """Reduces an integer tensor to its mean inside a training step, where half-precision plugins lower the
    default dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.means: List[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.means.append(self.trainer.strategy.reduce(torch.tensor(1001), reduce_op="mean"))
        return self.net(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _reduce_an_integer_under_bf16() -> List[torch.Tensor]:
    model = IntegerMeanInStep()
    trainer = pl.Trainer(
        strategy=CustomDDP(), precision="bf16-true", **trainer_kwargs(devices=1, max_epochs=1, max_steps=1)
    )
    trainer.fit(model, DataLoader(TensorDataset(torch.ones(2, 1)), batch_size=2))
    return model.means


ONE_PROCESS_CALLS["integer mean, bf16"] = (_reduce_an_integer_under_bf16, ())


def test_integer_mean_is_exact_and_at_least_float32_under_half_precision(in_one_process: Dict[str, Outcome]) -> None:
    """bfloat16 would round 1001 to 1000: the mean comes back in float32 however low the default dtype is."""
    [mean] = in_one_process["integer mean, bf16"].returned()
    assert mean.dtype == torch.float32 and mean.item() == 1001


class OrderRecorder(pl.LightningModule):
    """Records the sample indices of every training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.order: List[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.order += batch[0].long().flatten().tolist()
        return self.net(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_main_process_saves_a_checkpoint_after_a_spawn_fit(tmp_path: Path) -> None:
    """``save_checkpoint`` calls ``barrier``, whose exact-evaluation guard asked a module no Trainer is attached to
    any more (in the main process after a spawn launch) for its Trainer: RuntimeError. Stock DDP saves."""
    trainer = pl.Trainer(
        strategy=CustomDDP(start_method="spawn", timeout=TEST_PG_TIMEOUT), **trainer_kwargs(max_epochs=1)
    )
    trainer.fit(OrderRecorder(), DataLoader(TensorDataset(torch.ones(8, 1)), batch_size=2))
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt")
    assert torch.load(tmp_path / "after_fit.ckpt", weights_only=False)["state_dict"]


LAUNCH_MARK = "LIGHTNING_DDP_EXT_TEST_LAUNCH"  # an environment variable set in this process for one launch


class FitsOnesToOne(pl.LightningModule):
    """``w . x`` fitted to 1 on rows of ones: every batch is the same, so each DDP step equals one step of one
    process on one batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.constant_(self.net.weight, 0.25)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        deterministic = float(torch.are_deterministic_algorithms_enabled())
        self.log("deterministic_on_every_rank", deterministic, sync_dist=True, reduce_fx="min")
        launch_environment = float(os.environ.get(LAUNCH_MARK) == "this launch")
        self.log("launch_environment_on_every_rank", launch_environment, sync_dist=True, reduce_fx="min")
        return self.loss(batch[0])

    def loss(self, rows: torch.Tensor) -> torch.Tensor:
        return (self.net(rows) - 1).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_forkserver_ranks_on_cpu_train_parameters_of_their_own_with_the_launching_process_s_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's pickler moves the model's CPU tensors to shared memory for ``forkserver`` as for ``spawn``, and
    Lightning gives each rank its own copy for ``spawn`` only: two ``forkserver`` ranks trained one set of
    parameters, each step applied twice (weights that also changed from run to run). Lightning also sends
    torch's flags (``deterministic=True``) to ``spawn`` ranks only, and a forkserver rank had the environment
    of the server's first launch (a later ``PL_GLOBAL_SEED`` did not reach it)."""
    forkserver.ensure_running()  # started by an earlier launch, as in a process that fits twice
    monkeypatch.setenv(LAUNCH_MARK, "this launch")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # deterministic=True sets it here: restored after
    flags_before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    rows, batch_size = 16, 2
    expected = FitsOnesToOne()
    optimizer = expected.configure_optimizers()
    for _ in range(rows // batch_size // 2):  # the steps of one epoch, on each of 2 ranks
        optimizer.zero_grad()
        expected.loss(torch.ones(batch_size, 2)).backward()
        optimizer.step()
    model = FitsOnesToOne()
    strategy = CustomDDP(start_method="forkserver", timeout=TEST_PG_TIMEOUT)
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(max_epochs=1, deterministic=True))
    try:
        trainer.fit(model, DataLoader(TensorDataset(torch.ones(rows, 2)), batch_size=batch_size))
    finally:
        torch.use_deterministic_algorithms(flags_before[0], warn_only=flags_before[1])
    torch.testing.assert_close(model.net.weight, expected.net.weight)
    assert trainer.callback_metrics["deterministic_on_every_rank"].item() == 1.0
    assert trainer.callback_metrics["launch_environment_on_every_rank"].item() == 1.0


def _fit_then_resume_with_no_epoch_left() -> List[List[int]]:
    """A one-epoch fit that saves its last checkpoint, then a fit resumed from it with max_epochs=1: the epochs each
    set on its user's sampler (a sampler of each fit's own: a sampler records every epoch it is given)."""
    checkpoints = shared_directory("no epoch left")
    first, again = Recorder(), Recorder()
    saving = pl.callbacks.ModelCheckpoint(dirpath=checkpoints, save_last=True)
    pl.Trainer(
        strategy=CustomDDP(timeout=TEST_PG_TIMEOUT),
        **trainer_kwargs(max_epochs=1, enable_checkpointing=True, callbacks=[saving]),
    ).fit(first, DataLoader(IndexDataset(), batch_sampler=PKBatches(labels_for(), p=2, k=4, seed=0)))
    pl.Trainer(strategy=CustomDDP(timeout=TEST_PG_TIMEOUT), **trainer_kwargs(max_epochs=1)).fit(
        again,
        DataLoader(IndexDataset(), batch_sampler=PKBatches(labels_for(), p=2, k=4, seed=0)),
        ckpt_path=checkpoints / "last.ckpt",
    )
    return [records(model)["facts"]["epochs_set"]["only"] for model in (first, again)]


RANK_CALLS["resumed with no epoch left"] = (_fit_then_resume_with_no_epoch_left, ())


def test_a_resumed_fit_with_no_epoch_left_sets_no_epoch(on_two_ranks: CallOutcomes) -> None:
    """Resumed at max_epochs, Lightning's loop starts no epoch and sets none; the strategy set one ahead of it
    (a curriculum sampler advanced once more, and the repeat it expected never came)."""
    assert on_two_ranks.returned("resumed with no epoch left") == [[[0], []], [[0], []]]


class OrderRecorderWithValidation(OrderRecorder):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


def _warnings_of_a_fit_validating_on(val_dataloaders: Any) -> List[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(strategy=CustomDDP(), **trainer_kwargs(devices=1, max_epochs=1))
        trainer.fit(
            OrderRecorderWithValidation(), DataLoader(TensorDataset(torch.ones(4, 1)), batch_size=2), val_dataloaders
        )
    return [str(w.message) for w in caught]


NOT_DATALOADERS = {"empty": [], "list": [[(torch.ones(2, 1),)]]}
ONE_PROCESS_CALLS.update(
    {f"validating on, {kind}": (_warnings_of_a_fit_validating_on, (val,)) for kind, val in NOT_DATALOADERS.items()}
)


@pytest.mark.parametrize("kind, warned", [("empty", False), ("list", True)])
def test_a_loader_that_is_no_dataloader_is_warned_about_unless_empty(
    in_one_process: Dict[str, Outcome], kind: str, warned: bool
) -> None:
    """A list of batches cannot be sharded (every rank runs all of it); ``[]`` (no validation) has nothing to shard."""
    caught = in_one_process[f"validating on, {kind}"].returned()
    said = [message for message in caught if "is not a torch DataLoader, so it cannot be sharded" in message]
    assert bool(said) == warned, said


def _order_of_a_default_loader(global_seed: int, shuffle: bool = True, **options: Any) -> List[int]:
    """The samples one device trains on, in order, with a plain loader of 16 after ``seed_everything(global_seed)``."""
    pl.seed_everything(global_seed)
    model = OrderRecorder()
    trainer = pl.Trainer(strategy=CustomDDP(**options), **trainer_kwargs(devices=1, max_epochs=1))
    data = TensorDataset(torch.arange(16.0).unsqueeze(1))
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=shuffle))
    return model.order


DEFAULT_LOADER_RUNS: Dict[str, tuple] = {
    "seed 1": (1, True, {}),
    "seed 1 again": (1, True, {}),
    "seed 2": (2, True, {}),
    "seed 2, strategy seed 5": (2, True, {"seed": 5}),
    "seed 3, strategy seed 5": (3, True, {"seed": 5}),
    "seed 1, unshuffled": (1, False, {"shuffle_batches_between_ranks": True, "shuffle_window": 2}),
}


def _orders_of_default_loaders() -> Dict[str, List[int]]:
    return {run: _order_of_a_default_loader(seed, shuffle, **options)
            for run, (seed, shuffle, options) in DEFAULT_LOADER_RUNS.items()}


ONE_PROCESS_CALLS["default loaders"] = (_orders_of_default_loaders, ())


def test_default_loaders_take_seed_everythings_seed_and_keep_their_shuffle(in_one_process: Dict[str, Outcome]) -> None:
    """Plain loaders get a DistributedSampler seeded like stock Lightning's (seed_everything's seed, unless the
    strategy is given one), so runs with different seeds see different orders; shuffle=False stays in order,
    whatever the batch shuffle of custom samplers says."""
    order = in_one_process["default loaders"].returned()
    first = order["seed 1"]
    assert sorted(first) == list(range(16)) and first != list(range(16))
    assert order["seed 1 again"] == first and order["seed 2"] != first
    assert order["seed 2, strategy seed 5"] == order["seed 3, strategy seed 5"]  # an explicit seed wins
    assert order["seed 1, unshuffled"] == list(range(16))
    with pytest.raises(ValueError, match=re.escape("seed must be an integer in [-2**63, 2**63 - 1], got 1.5")):
        CustomDDP(seed=1.5)  # type: ignore[arg-type]


def _first_batch_of_three_epochs_with_the_batch_shuffle(
    default_sampler: bool, trainer_options: Dict[str, Any]
) -> Tuple[List[List[int]], List[str]]:
    """Each epoch's first batch of six pairs (a list of them, or a plain loader), and the user warnings given."""
    model = OrderRecorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(
            strategy=CustomDDP(shuffle_batches_between_ranks=True, seed=3),
            **trainer_kwargs(devices=1, max_epochs=3, **trainer_options),
        )
        data = TensorDataset(torch.arange(12.0).unsqueeze(1))
        pairs = [[2 * i, 2 * i + 1] for i in range(6)]
        sampling = dict(batch_size=2) if default_sampler else dict(batch_sampler=pairs)
        trainer.fit(model, DataLoader(data, **sampling))  # type: ignore[arg-type]
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return [model.order[epoch * 2 : epoch * 2 + 2] for epoch in range(3)], said


BATCH_SHUFFLE_RUNS = {
    "overfit": (False, {"overfit_batches": 1}),
    "limited": (False, {"limit_train_batches": 1}),
    "overfit, plain loader": (True, {"overfit_batches": 1}),
}
ONE_PROCESS_CALLS.update(
    {f"batch shuffle, {run}": (_first_batch_of_three_epochs_with_the_batch_shuffle, args)
     for run, args in BATCH_SHUFFLE_RUNS.items()}
)


def test_overfit_batches_deals_the_same_batches_every_epoch_despite_the_batch_shuffle(
    in_one_process: Dict[str, Outcome]
) -> None:
    """overfit_batches trains on the same batches every epoch (Lightning turns a loader's own shuffling off):
    the batch shuffle of a custom sampler goes off too, with a warning, instead of overfitting other batches."""
    message = "overfit_batches is set, so this training loader's batches are dealt without"
    overfit, said = in_one_process["batch shuffle, overfit"].returned()
    assert [m for m in said if message in m], said
    assert overfit == [[0, 1]] * 3, overfit  # the sampler's first batch, as without the strategy
    shuffled, _ = in_one_process["batch shuffle, limited"].returned()
    assert len({tuple(batch) for batch in shuffled}) > 1, shuffled  # the shuffle itself is still on otherwise
    plain, said = in_one_process["batch shuffle, overfit, plain loader"].returned()
    assert plain == [[0, 1]] * 3, plain
    assert not [m for m in said if message in m], said  # the batch shuffle never applied to a default sampler


class PairsShuffledInSetEpoch:
    """Six batches of two, in an order drawn anew in its own ``set_epoch`` (a batch sampler without ``sampler``)."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 6

    def __iter__(self) -> Iterator[List[int]]:
        order = torch.randperm(6, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        return iter([[2 * i, 2 * i + 1] for i in order])


def _first_batch_of_three_epochs_shuffled_in_set_epoch(trainer_options: Dict[str, Any]) -> List[List[int]]:
    model = OrderRecorder()
    trainer = pl.Trainer(strategy=CustomDDP(), **trainer_kwargs(devices=1, max_epochs=3, **trainer_options))
    data = TensorDataset(torch.arange(12.0).unsqueeze(1))
    trainer.fit(model, DataLoader(data, batch_sampler=PairsShuffledInSetEpoch()))
    return [model.order[epoch * 2 : epoch * 2 + 2] for epoch in range(3)]


ONE_PROCESS_CALLS.update(
    {
        "own set_epoch, overfit": (_first_batch_of_three_epochs_shuffled_in_set_epoch, ({"overfit_batches": 1},)),
        "own set_epoch, limited": (_first_batch_of_three_epochs_shuffled_in_set_epoch, ({"limit_train_batches": 1},)),
    }
)


def test_overfit_batches_leaves_a_batch_samplers_own_set_epoch_uncalled_as_one_process_does(
    in_one_process: Dict[str, Outcome]
) -> None:
    """A single-process Lightning loop calls set_epoch on loader.batch_sampler.sampler, never on a custom batch
    sampler itself: under overfit_batches it overfits epoch 0's first batch every epoch. The strategy forwarded
    the epoch to the batch sampler, which drew other batches each epoch; otherwise it still does."""
    first = next(iter(PairsShuffledInSetEpoch()))
    assert in_one_process["own set_epoch, overfit"].returned() == [first] * 3
    forwarded = in_one_process["own set_epoch, limited"].returned()
    assert forwarded[0] == first and len({tuple(batch) for batch in forwarded}) > 1, forwarded


class SeededPerRank(Recorder):
    """Seeds each rank differently, as users do to vary augmentation."""

    def setup(self, stage: str) -> None:
        pl.seed_everything(100 + self.global_rank)


def _fit_seeded_per_rank() -> Dict[str, Any]:
    model = SeededPerRank()
    pl.Trainer(strategy="ddp_custom_sampler", **trainer_kwargs(max_epochs=1)).fit(
        model, DataLoader(IndexDataset(), batch_size=4, shuffle=True)
    )
    return records(model)


RANK_CALLS["seeded per rank"] = (_fit_seeded_per_rank, ())


def test_ranks_seeded_differently_still_deal_disjoint_shares_of_a_plain_loader(on_two_ranks: CallOutcomes) -> None:
    """The default seed is rank 0's seed_everything seed: per-rank seeds would give each rank's DistributedSampler
    another permutation, so the shares would overlap and miss samples, silently."""
    reports = on_two_ranks.returned("seeded per rank")
    shares = [[i for _, batch in report["seen"]["train/only"] for i in batch] for report in reports]
    assert sorted(shares[0] + shares[1]) == list(range(DATASET_SIZE))


class EmptyValidation(OrderRecorder):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        raise AssertionError("an empty validation split has no batch")


def _fit_with_an_empty_plain_validation_split() -> Tuple[bool, List[int]]:
    model = EmptyValidation()
    trainer = pl.Trainer(strategy=CustomDDP(), **trainer_kwargs(devices=1, max_epochs=1))
    data = TensorDataset(torch.arange(8.0).unsqueeze(1))
    trainer.fit(model, DataLoader(data, batch_size=4), DataLoader(TensorDataset(torch.empty(0, 1)), batch_size=4))
    return trainer.state.finished, model.order


ONE_PROCESS_CALLS["empty plain validation"] = (_fit_with_an_empty_plain_validation_split, ())


def test_an_empty_plain_validation_split_is_skipped_as_stock_lightning_does(in_one_process: Dict[str, Outcome]) -> None:
    """An empty split under a plain loader gets 0 batches (Lightning warns), it does not fail the fit."""
    finished, order = in_one_process["empty plain validation"].returned()
    assert finished and sorted(order) == list(range(8))


class StopHere(Exception):
    """Ends a fit where a test wants it, after a checkpoint."""


class Crashing(pl.LightningModule):
    """Records its batches; with ``crash_at`` = (hook, batch index), saves a checkpoint there in epoch 0 and stops,
    as OnExceptionCheckpoint does after a failure in that hook."""

    def __init__(self, checkpoint: Path, crash_at: Optional[tuple] = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.checkpoint, self.crash_at = checkpoint, crash_at
        self.seen: List[List[int]] = []

    def _maybe_stop(self, hook: str, batch_idx: int) -> None:
        if self.crash_at == (hook, batch_idx) and self.current_epoch == 0:
            self.trainer.save_checkpoint(self.checkpoint)
            raise StopHere

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._maybe_stop("on_train_batch_start", batch_idx)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._maybe_stop("training_step", batch_idx)
        self.seen.append(batch[0].flatten().long().tolist())
        return self.net(batch[0].float()).sum()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._maybe_stop("on_train_batch_end", batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit_crashing(model: Crashing, **fit_options: Any) -> List[List[int]]:
    trainer = pl.Trainer(
        strategy=CustomDDP(shuffle_batches_between_ranks=True, seed=3), **trainer_kwargs(devices=1, max_epochs=2)
    )
    data = TensorDataset(torch.arange(8).unsqueeze(1))
    try:
        trainer.fit(model, DataLoader(data, batch_sampler=[[0, 1], [2, 3], [4, 5], [6, 7]]), **fit_options)
    except StopHere:
        pass
    return model.seen


def _stop_in_the_last_batch_then_resume(hook: str) -> Tuple[List[List[int]], List[List[int]], List[List[int]]]:
    """The batches of the uninterrupted run, of a run stopped in ``hook`` of epoch 0's last batch, and of its resume."""
    checkpoint = shared_directory(f"stopped in {hook}") / "stop.ckpt"
    whole = _fit_crashing(Crashing(checkpoint))
    first = _fit_crashing(Crashing(checkpoint, crash_at=(hook, 3)))
    return whole, first, _fit_crashing(Crashing(checkpoint), ckpt_path=checkpoint)


LAST_BATCH_HOOKS = ["on_train_batch_start", "training_step", "on_train_batch_end"]
ONE_PROCESS_CALLS.update(
    {f"stopped in {hook}": (_stop_in_the_last_batch_then_resume, (hook,)) for hook in LAST_BATCH_HOOKS}
)


@pytest.mark.parametrize("hook", LAST_BATCH_HOOKS)
def test_a_checkpoint_during_the_last_batch_of_an_epoch_resumes_like_the_uninterrupted_run(
    in_one_process: Dict[str, Outcome], hook: str
) -> None:
    """Lightning marks the last batch when it fetches it: a checkpoint written before that batch's step ended
    re-runs it (the epoch is not over), one written after it starts the next epoch. Either way the resumed
    run trains the batches the uninterrupted one trains, in the same order."""
    if hook == "on_train_batch_end" and not hasattr(_compat_training_epoch_loop(), "restarted_on_train_batch_end"):
        pytest.skip("this Lightning re-runs the batch whose on_train_batch_end wrote the checkpoint")
    whole, first, resumed = in_one_process[f"stopped in {hook}"].returned()
    assert resumed == whole[len(first):]


def _compat_training_epoch_loop() -> type:
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    return _TrainingEpochLoop


@pytest.mark.parametrize("end", ["teardown", "on_exception"])
def test_the_end_of_a_fit_drops_the_resume_skips_it_left_untaken(end: str) -> None:
    """A resumed fit with no step left, or one that failed before training read its loader, leaves the skip it
    set pending on a wrapper its user may keep (with the trainer it refers to): the fit's end drops it, and only
    the skips this strategy set (Lightning 2.2 calls on_exception, not teardown, after a KeyboardInterrupt)."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator

    from lightning_ddp_ext import strategy as strategy_module
    from lightning_ddp_ext.samplers import DistributedBatchSamplerWrapper

    ours, theirs = (CustomDDP(accelerator=CPUAccelerator(), cluster_environment=LightningEnvironment()) for _ in "ab")
    mine, other = (DistributedBatchSamplerWrapper([[i] for i in range(8)], 2, 0) for _ in range(2))
    for wrapper, owner in ((mine, ours), (other, theirs)):
        wrapper.resume_within_epoch(0, 2)
        strategy_module._PENDING_SKIPS[wrapper] = id(owner)
    getattr(ours, end)(*([RuntimeError("failed")] if end == "on_exception" else []))
    assert len(list(mine)) == 4 and len(list(other)) == 2
    assert list(strategy_module._PENDING_SKIPS.values()) == [id(theirs)]
    theirs.teardown()
    assert not strategy_module._PENDING_SKIPS


def test_a_wrapper_under_torchdata_s_batch_sampler_is_found() -> None:
    """A StatefulDataLoader batches with torchdata's copy of BatchSampler: the user's wrapper under it gets the
    early set_epoch, the resume skip and evaluated_indices() as under torch's."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from lightning_ddp_ext._loader_shares import wrapper_of
    from lightning_ddp_ext.samplers import DistributedSamplerWrapper

    wrapper = DistributedSamplerWrapper(range(8), num_replicas=2, rank=0)
    batches = stateful.sampler.BatchSampler(wrapper, batch_size=2, drop_last=False)
    assert wrapper_of(stateful.StatefulDataLoader(range(8), batch_sampler=batches)) is wrapper
    assert wrapper_of(stateful.StatefulDataLoader(range(8), sampler=wrapper, batch_size=2)) is wrapper


@pytest.mark.parametrize(
    "start_method,advice",
    [
        ("popen", "='ddp_custom_sampler_find_unused_parameters_true' or CustomDDP(find_unused_parameters=True)."),
        ("spawn", "use CustomDDP(find_unused_parameters=True, start_method='spawn')."),
    ],
)
def test_the_unused_parameters_error_gets_advice_for_the_start_method_in_use(start_method: str, advice: str) -> None:
    """DDP's "Expected to have finished reduction" gets what to change; only popen has a registered name for it."""
    error = RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one.")
    CustomDDP(start_method=start_method).on_exception(error)
    assert str(error).startswith("Expected to have finished reduction") and str(error).endswith(advice), str(error)


def test_a_loss_through_a_reentrant_checkpoint_counts_as_reaching_the_parameters() -> None:
    """A reentrant torch.utils.checkpoint (Hugging Face's default for years) links the loss to the segment's
    inputs only: its parameters are reached when backward runs the segment again. Such a loss was refused as one
    that "depends on no parameter", where stock "ddp" trains it; a loss of inputs alone still is refused."""
    from lightning_ddp_ext._gradients import reaches_a_parameter
    from torch.utils.checkpoint import checkpoint

    layer, x = torch.nn.Linear(2, 2), torch.randn(3, 2, requires_grad=True)
    assert reaches_a_parameter(checkpoint(layer, x, use_reentrant=True).sum())
    assert reaches_a_parameter(checkpoint(layer, x, use_reentrant=False).sum())
    assert reaches_a_parameter(layer(x).sum())
    assert not reaches_a_parameter((x * 2).sum())
    assert not reaches_a_parameter(torch.zeros((), requires_grad=True))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_loss_that_reaches_no_parameter_on_one_rank_is_refused_where_gradients_are_all_reduced(
    accumulate: int,
) -> None:
    """Rank 1's loss of batch 1 reaches no parameter: its backward would run none of DDP's all-reduces and rank 0
    would wait in its own until the timeout (stock "ddp" does). Refused on that rank, which ends the job. Inside
    no_sync (batch 0 of 2 accumulated) nothing is all-reduced, and such a loss is left alone."""
    strategy = CustomDDP(start_method="spawn", timeout=TEST_PG_TIMEOUT)
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(max_epochs=1, accumulate_grad_batches=accumulate))
    model = ConstantLossOnRankOne(at_batch=1 if accumulate == 1 else 0)
    if accumulate == 1:
        with pytest.raises(Exception, match=r"CustomDDP: the loss of this backward pass on rank 1 depends on no"
                                            r" parameter .* e\.g\. embeddings\.sum\(\) \* 0"):
            trainer.fit(model, line_loader())
        return
    trainer.fit(model, line_loader())
    assert trainer.state.finished
