"""Parameters whose ``requires_grad`` changes during a fit (Lightning's ``BaseFinetuning``) train as on one process.

torch's DistributedDataParallel registers its gradient hooks, at construction, for the parameters that require
grad then. A backbone unfrozen at a later epoch is never all-reduced under it (each rank steps on its own
gradient: the ranks' weights drift apart, silently), and a parameter frozen after wrapping leaves DDP waiting
for a gradient that never comes. CustomDDP re-wraps the model when the flags change (Lightning issue #20340).

Three 2-rank fits, two of them against a 1-process fit on the combined batches (made on each rank beside its
run). They and the checks of single parts below are calls made on two ranks started once for the module
(``on_two_ranks``, see ``distributed_helpers.call_on_ranks``):

* the backbone joins at epoch 1; the head and an expert leave in the middle of an accumulation window of epoch 2
  (``accumulate_grad_batches=2``). The window's first gradient must be averaged across ranks, as Adam still
  steps them; with ``find_unused_parameters=True`` only rank 0's data goes through the expert, so only rank 0
  holds its gradient; an early expert, still trainable, is reached only in the window's first micro-batch, before
  the re-wrap, on rank 0 (stock DDP remembers that across ``no_sync``; a new wrapper does not, so the strategy
  averages every held gradient at the re-wrap). A ``configure_ddp`` override registers a counting comm hook
  (re-wrapping must go through the override, and ``no_sync`` must still skip the accumulating steps);
* the same schedule, without accumulation, with manual optimization and ``static_graph=True`` (Lightning
  flushes the first static-graph iteration of each new wrapper);
* the same schedule, without accumulation, with PowerSGD, whose per-bucket error feedback must restart with
  the new buckets (no reference: PowerSGD is lossy, but both ranks must end equal).

The error for ranks that froze different parameters is checked without a fit.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional
from unittest.mock import patch

import lightning
import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BaseFinetuning
from packaging.version import Version
from distributed_helpers import CallOutcomes, RankCalls, one_process, run_python
from scenarios import TEST_PG_TIMEOUT, BackboneAndHead, trainer_kwargs, weights
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.utils.data import DataLoader, Dataset

from lightning_ddp_ext import CustomDDP, _compat, _gradients

pytestmark = pytest.mark.usefixtures("spawn_job")

#: The runs made on the module's two ranks, filled in beside the tests that check them.
RANK_CALLS: RankCalls = {}

SIZE = 16  # per rank: 4 batches of 2, 2 optimizer steps per epoch with accumulate_grad_batches=2
EPOCHS = 3


class Points(Dataset):
    """Seeded regression points: item i is (x_i, y_i). The last feature is +1 for even items, -1 for odd ones:
    rank 0 is dealt the even items, rank 1 the odd ones."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 8, generator=generator)
        self.x[:, 7] = 1.0 - 2.0 * (torch.arange(size) % 2)
        self.x[0, 6] = 10.0  # item 0, in rank 0's first batch of every epoch, alone reaches Routed's early expert
        self.y = self.x[:, :1] * 2 - self.x[:, 1:2] + 0.1 * torch.randn(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class FineTuned(BackboneAndHead):
    """A backbone and a head; ``report()`` gives its weights and what its strategy recorded."""

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.01)

    def report(self) -> Dict[str, Any]:
        return {"weights": weights(self), "wraps": getattr(self.trainer.strategy, "wraps", None)}


class Routed(FineTuned):
    """With an expert that only samples whose last feature is positive go through (a mixture of experts, a
    conditional head): rank 0's, all of them, and none of rank 1's; and an early expert that only item 0 goes
    through: the first micro-batch of each epoch, on rank 0, so none after the re-wrap inside epoch 2's first
    window (the new wrapper, which did not see that micro-batch, finds it unused by every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.expert = torch.nn.Linear(4, 1)
        self.early_expert = torch.nn.Linear(4, 1)
        self.expert_gradient_held: Optional[bool] = None  # when it was frozen (see Finetuning)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        features = self.backbone(x)
        prediction = self.head(features)
        routed = x[:, 7:] > 0
        if routed.any():  # a batch without routed samples leaves the expert out of the graph: no gradient at all
            prediction = prediction + routed * self.expert(features)
        early = x[:, 6:7] > 5
        if early.any():
            prediction = prediction + early * self.early_expert(features)
        return torch.nn.functional.mse_loss(prediction, y)

    def report(self) -> Dict[str, Any]:
        return {**super().report(), "expert_gradient_held": self.expert_gradient_held}


class Finetuning(BaseFinetuning):
    """The backbone joins the optimizer as a new group at epoch 1; the head (and the expert) are frozen at batch 1
    of epoch 2."""

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=0.01)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.current_epoch == 2 and idx == 1:  # the second micro-batch of the epoch's first window
            self.freeze(pl_module.head)
            if isinstance(pl_module, Routed):
                pl_module.expert_gradient_held = pl_module.expert.weight.grad is not None
                self.freeze(pl_module.expert)


def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]
    """Count the gradient all-reduce rounds of one wrapper, then all-reduce as DDP would (unannotated: DDP
    compares annotations with real classes, and this module's are strings)."""
    state["rounds"] += 1
    return default_hooks.allreduce_hook(None, bucket)


class RecordingDDP(CustomDDP):
    """A user's configure_ddp override: registers a comm hook and records each wrapper it builds."""

    def configure_ddp(self, model: torch.nn.Module, device_ids: Optional[List[int]]) -> torch.nn.Module:
        wrapped = super().configure_ddp(model, device_ids)
        state = {"trainable": sum(p.requires_grad for p in model.parameters()), "rounds": 0}
        wrapped.register_comm_hook(state, counting_allreduce)  # type: ignore[operator]
        self.wraps: List[Dict[str, int]] = [*getattr(self, "wraps", []), state]
        return wrapped


def fit(batch_size: int, module: type = FineTuned, **overrides: Any) -> Dict[str, Any]:
    """A fit of ``module`` on :class:`Points` for ``EPOCHS`` epochs under the :class:`Finetuning` schedule, with
    ``accumulate_grad_batches=2`` unless overridden; returns the module's report."""
    defaults = {"callbacks": [Finetuning()], "max_epochs": EPOCHS, "accumulate_grad_batches": 2}
    kwargs = trainer_kwargs(**{**defaults, **overrides})
    model = module()
    pl.Trainer(**kwargs).fit(model, DataLoader(Points(SIZE), batch_size=batch_size))
    return model.report()


def _fit_on_the_ranks_and_as_one_process(strategy: Callable[[], CustomDDP], module: type, accumulate: int) -> Any:
    """This rank's report of a 2-rank fit, and the weights of the same fit on 1 process (on each rank: the same)."""
    # per rank: dealt 0, 2, 4, ... and 1, 3, 5, ...; each batch of the 1-process run is the two ranks' together
    ranks = fit(batch_size=2, module=module, strategy=strategy(), accumulate_grad_batches=accumulate)
    with one_process():
        reference = fit(batch_size=4, module=module, devices=1, accumulate_grad_batches=accumulate)
    return ranks, reference["weights"]


def assert_trained_as_one_process(outcomes: List[Any], module: type) -> List[Dict[str, Any]]:
    """Assert that both ranks end with the weights of the 1-process run (rank 0's, to rounding) and with equal
    weights; return the ranks' reports."""
    ranks = [report for report, _ in outcomes]
    reference = outcomes[0][1]
    initial = module().state_dict()
    for name, value in reference.items():
        assert not torch.equal(value, initial[name]), name  # every parameter trained in the reference
        for rank, report in enumerate(ranks):
            difference = (report["weights"][name] - value).abs().max().item()
            assert difference <= 1e-5, (rank, name, difference)
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
    return ranks


def _recording_strategy() -> CustomDDP:
    return RecordingDDP(timeout=TEST_PG_TIMEOUT, find_unused_parameters=True)


RANK_CALLS["routed"] = (_fit_on_the_ranks_and_as_one_process, (_recording_strategy, Routed, 2))


def test_parameters_unfrozen_and_frozen_during_fit_train_as_on_one_process(on_two_ranks: CallOutcomes) -> None:
    """Fails without re-wrapping: the backbone's gradients stay per rank from epoch 1, so the ranks' backbones
    differ, and differ from the 1-process run's. Fails too when the ranks compare whether they hold gradients of
    the newly frozen parameters (a false "differ between ranks" error: only rank 0 holds the expert's), and when
    rank 1 does not take zeros for the expert's gradient (the ranks' all-reduces no longer match), and when only
    the newly frozen parameters' gradients are averaged at the re-wrap: the early expert's local sum from the
    window's first micro-batch then stays on rank 0 alone, and only rank 0 steps it."""
    ranks = assert_trained_as_one_process(on_two_ranks.returned("routed"), Routed)
    assert [report["expert_gradient_held"] for report in ranks] == [True, False]

    # Wrapped 3 times through the override: head and experts (6 tensors), + backbone (10), backbone and early
    # expert (6); each
    # wrapper's comm hook reduced once per optimizer step it ended (2 each: no_sync skipped the accumulating
    # micro-batches, the one before the last re-wrap included).
    for report in ranks:
        assert report["wraps"] == [{"trainable": n, "rounds": 2} for n in (6, 10, 6)], report["wraps"]


class ManualFineTuned(FineTuned):
    """FineTuned with manual optimization: one step per batch, gradients set to None after it."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()  # type: ignore[union-attr]
        optimizer.zero_grad()  # type: ignore[union-attr]


STATIC_GRAPH_FLUSHED = Version(lightning.__version__) >= Version("2.6.0")
needs_static_graph_flush = pytest.mark.skipif(
    not STATIC_GRAPH_FLUSHED,
    reason="Lightning before 2.6.0 does not synchronise the first step of manual optimization with"
    " static_graph=True at all, re-wrapped or not (Lightning #21251)",
)


def _static_graph_strategy() -> CustomDDP:
    return CustomDDP(timeout=TEST_PG_TIMEOUT, static_graph=True)


if STATIC_GRAPH_FLUSHED:
    RANK_CALLS["manual, static graph"] = (
        _fit_on_the_ranks_and_as_one_process, (_static_graph_strategy, ManualFineTuned, 1)
    )


@needs_static_graph_flush
def test_manual_optimization_with_static_graph_across_re_wraps(on_two_ranks: CallOutcomes) -> None:
    """Fails without letting Lightning flush the first static-graph iteration of each new wrapper: that step's
    gradients are not all-reduced, and the ranks drift apart (by 0.1 here)."""
    assert_trained_as_one_process(on_two_ranks.returned("manual, static graph"), ManualFineTuned)


@pytest.mark.timeout(300)
@needs_static_graph_flush
def test_manual_optimization_with_static_graph_in_a_second_fit_of_the_same_ranks(tmp_path: Path) -> None:
    """Under popen the ranks and the strategy live on between fits: Lightning's once-per-strategy flag for the first
    static-graph iteration must start again with the wrapper the second fit builds, or that step's gradients are
    not all-reduced and the ranks drift apart for good (steps 3-4 here)."""
    script = Path(__file__).parent / "scripts" / "static_graph_refit.py"
    run_python(str(script), str(tmp_path), timeout=240, cwd=tmp_path)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert len(ranks[0]) == 4  # 2 steps per epoch on each rank: one epoch in each fit
    assert ranks[0] == ranks[1]


class PowerSGDFineTuned(FineTuned):
    def report(self) -> Dict[str, Any]:
        state = _compat.comm_hook_arguments(self.trainer.strategy)[0]
        assert isinstance(state, PowerSGDState)
        return {**super().report(), "error_feedback": len(state.error_dict), "start": state.start_powerSGD_iter}


def _fit_with_powersgd() -> Dict[str, Any]:
    state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    strategy = CustomDDP(timeout=TEST_PG_TIMEOUT, ddp_comm_state=state, ddp_comm_hook=powerSGD_hook)
    # 4 steps per epoch; the re-wraps at steps 4 and 9 each leave the new wrapper's first step uncompressed
    return fit(batch_size=2, module=PowerSGDFineTuned, accumulate_grad_batches=1, strategy=strategy)


RANK_CALLS["powersgd"] = (_fit_with_powersgd, ())


def test_powersgd_error_feedback_restarts_with_the_new_buckets(on_two_ranks: CallOutcomes) -> None:
    """Fails without clearing PowerSGD's per-bucket state: compression started at step 2, before the unfreeze
    at step 4 (then "The size of tensor a (217) must match the size of tensor b (5)")."""
    ranks = on_two_ranks.returned("powersgd")
    initial = FineTuned().state_dict()
    for name, value in ranks[0]["weights"].items():
        assert not torch.equal(value, initial[name]), name
        assert torch.equal(value, ranks[1]["weights"][name]), name
    for report in ranks:  # compression ran on the last wrapper, after its first step
        assert report["error_feedback"] > 0 and report["start"] == 10, report


def _agree_on_flags() -> List[Optional[str]]:
    """On a real gloo group: the same flags agree; then rank 1 unfreezes one tensor fewer than rank 0."""
    rank = dist.get_rank()
    module = FineTuned()
    strategy = CustomDDP(parallel_devices=[torch.device("cpu")])
    strategy.connect(module)
    strategy._wrapped_parameters = list(module.parameters())
    flags = [True] * 6
    errors: List[Optional[str]] = []
    for case in ("same", "different"):
        if case == "different" and rank == 1:
            flags[3] = False  # backbone.2.bias
        try:
            strategy._agree_on_requires_grad(flags)
            errors.append(None)
        except RuntimeError as error:
            errors.append(str(error))
    return errors


RANK_CALLS["flags"] = (_agree_on_flags, ())


# Torch 2.13 lets a parameter's gradient have a dtype of its own (grad_dtype); torch 2.6 does not. The dtype of
# the bfloat16 parameter's gradient in _average_partly_held.
GRAD_DTYPE_SETTABLE = hasattr(torch.Tensor, "grad_dtype")
HALF_GRAD_DTYPE = torch.float32 if GRAD_DTYPE_SETTABLE else torch.bfloat16


def _average_partly_held() -> Dict[str, Any]:
    """On a real gloo group: gradients held on rank 0 only, one of them sparse, one of another dtype than its
    parameter's (torch's grad_dtype, where torch has it), one held nowhere; and one held on both ranks, in
    several buffers."""
    rank = dist.get_rank()
    embedding = torch.nn.Embedding(4, 2, sparse=True)
    dense, nowhere = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    half = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    if GRAD_DTYPE_SETTABLE:
        half.grad_dtype = HALF_GRAD_DTYPE  # type: ignore[attr-defined]
    both = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    for number, parameter in enumerate(both):
        parameter.grad = torch.full((2,), 2.0 * rank + number)
    large = torch.nn.Parameter(torch.zeros(1, dtype=torch.float16))
    large.grad = torch.full((1,), 40000.0, dtype=torch.float16)  # averaged already: a sum first would overflow
    if rank == 0:
        embedding(torch.tensor([1, 1])).sum().backward()  # sparse gradient: 2 on row 1
        dense.grad = torch.full((3,), 2.0)
        # a float32 gradient where torch allows: without the agreement rank 1 would make bfloat16 zeros
        half.grad = torch.full((3,), 2.0, dtype=HALF_GRAD_DTYPE)
    reduced: List[Any] = []  # what each all-reduce took: its number of elements, or "sparse"
    all_reduce = torch.distributed.all_reduce

    def recording_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reduced.append("sparse" if tensor.is_sparse else tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    with patch.object(_gradients, "AVERAGE_BUFFER_BYTES", 16), patch.object(
        _gradients.dist, "all_reduce", recording_all_reduce
    ):
        parameters = [embedding.weight, dense, nowhere, half, *both, large]
        _gradients.average_held_gradients(parameters, None, torch.device("cpu"))
    return {
        "reduced": reduced,
        "sparse": embedding.weight.grad.is_sparse,
        "embedding": embedding.weight.grad.to_dense().tolist(),
        "dense": dense.grad.tolist(),
        "nowhere": nowhere.grad,
        "half": (half.grad.dtype, half.grad.tolist()),
        "both": [parameter.grad.tolist() for parameter in both],
        "large": large.grad.tolist(),
    }


RANK_CALLS["partly held"] = (_average_partly_held, ())


def test_gradients_held_on_some_ranks_only_are_averaged(on_two_ranks: CallOutcomes) -> None:
    """The ranks without one take zeros of the same layout (sparse here) and dtype, and enter the same
    all-reduces."""
    # the agreement (3 rows of 8), the sparse gradient, then flat float32 buffers of at most 16 bytes: dense (12),
    # half's float32 gradient (12), both[0] and both[1] (8 + 8), both[2] (8); then float16. Where half's gradient
    # is bfloat16 it gets a buffer of its own, after the float32 ones.
    reduced = [24, "sparse", 3, 3, 4, 2, 1] if GRAD_DTYPE_SETTABLE else [24, "sparse", 3, 4, 2, 3, 1]
    for rank, result in enumerate(on_two_ranks.returned("partly held")):
        assert result == {
            "reduced": reduced,
            "sparse": True,
            "embedding": [[0, 0], [1, 1], [0, 0], [0, 0]],
            "dense": [1.0] * 3,
            "nowhere": None,
            "half": (HALF_GRAD_DTYPE, [1.0] * 3),
            "both": [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]],
            "large": [40000.0],
        }, (rank, result)


def test_ranks_that_froze_different_parameters_are_told_which(on_two_ranks: CallOutcomes) -> None:
    """The error names the parameter, on every rank."""
    for rank, (same, different) in enumerate(on_two_ranks.returned("flags")):
        assert same is None, (rank, same)
        assert different is not None, rank
        message = r"backbone\.2\.bias requires grad on rank\(s\) \[0\] but not on rank\(s\) \[1\] .*: \{0: 6, 1: 5\}"
        assert re.search(message, different), (rank, different)


def _rewrap_mixed_precision() -> Optional[str]:
    """On a real gloo group: a model wrapped with DDP's experimental mixed_precision, whose flags then change."""
    from torch.nn.parallel.distributed import DistributedDataParallel, _MixedPrecision

    module = torch.nn.Linear(2, 2)
    strategy = CustomDDP(parallel_devices=[torch.device("cpu")])
    strategy.model = DistributedDataParallel(module, mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
    strategy._wrapped_parameters = list(module.parameters())
    strategy._wrapped_requires_grad = [True, True]
    module.bias.requires_grad_(False)
    try:
        strategy._rewrap_for_changed_requires_grad([True, False])
    except RuntimeError as error:
        return str(error)
    return None


DDP_MIXED_PRECISION_RUNS = not torch.backends.cuda.is_built() or torch.cuda.is_available()
needs_an_accelerator_if_built_for_one = pytest.mark.skipif(
    not DDP_MIXED_PRECISION_RUNS,
    reason="DDP's mixed precision makes a stream on the build's accelerator: a CUDA build needs a usable GPU",
)
if DDP_MIXED_PRECISION_RUNS:
    RANK_CALLS["mixed precision"] = (_rewrap_mixed_precision, ())


@needs_an_accelerator_if_built_for_one
def test_a_model_wrapped_with_ddp_mixed_precision_is_not_wrapped_again(on_two_ranks: CallOutcomes) -> None:
    """Its forward hooks on every submodule cannot be removed: the old wrapper would keep casting (and stay
    alive) beside the new one. The error says what to use instead."""
    for message in on_two_ranks.returned("mixed precision"):
        assert message is not None and re.search(
            r"experimental mixed_precision argument, whose forward hooks cannot be removed.*precision='bf16-mixed'",
            message,
        ), message


class WithLocalParameter(torch.nn.Module):
    """A shared layer, and a parameter of each rank's own that DDP is told to ignore (its shape differs by rank)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = torch.nn.Linear(2, 2)
        self.own = torch.nn.Module()  # torch's DDP ignores parameters of submodules only (".local" at the root)
        self.own.local = torch.nn.Parameter(torch.zeros(rank + 1))
        self._ddp_params_and_buffers_to_ignore = ["own.local"]


def _rewrap_with_an_ignored_parameter() -> Dict[str, Any]:
    """On a real gloo group: a re-wrap (the shared bias frozen) while the ignored parameter holds a gradient."""
    from torch.nn.parallel.distributed import DistributedDataParallel

    rank = dist.get_rank()
    module = WithLocalParameter(rank)
    strategy = CustomDDP(parallel_devices=[torch.device("cpu")])
    strategy.model = DistributedDataParallel(module)
    strategy._wrapped_parameters = list(module.parameters())
    strategy._wrapped_requires_grad = [True, True, True]
    module.own.local.grad = torch.full((rank + 1,), float(rank))
    module.shared.bias.grad = torch.full((2,), float(rank))
    module.shared.bias.requires_grad_(False)
    strategy._rewrap_for_changed_requires_grad([True, False, True])
    return {
        "rewrapped": isinstance(strategy.model, DistributedDataParallel) and strategy.model.module is module,
        "local": module.own.local.grad.tolist(),
        "bias": module.shared.bias.grad.tolist(),
    }


RANK_CALLS["ignored parameter"] = (_rewrap_with_an_ignored_parameter, ())


def test_parameters_ddp_ignores_keep_their_gradients_at_a_re_wrap(on_two_ranks: CallOutcomes) -> None:
    """DDP never reduced them, and they may differ between ranks (averaging them aborted gloo on a size mismatch)."""
    for rank, result in enumerate(on_two_ranks.returned("ignored parameter")):
        assert result == {"rewrapped": True, "local": [float(rank)] * (rank + 1), "bias": [0.5, 0.5]}, (rank, result)
