"""Gathering validation outputs across ranks through the strategy, in "pad" and "exact" evaluation modes.

Most runs here are the calls of ``RANK_CALLS``, made one after another on two ranks started once for the module,
as a script run by torchrun makes several Trainers (``on_two_ranks``, see ``distributed_helpers.call_on_ranks``):
starting ranks, not the runs, is what costs. Each test then checks its call's outcome on every rank. One-device
runs are the calls of ``ONE_PROCESS_CALLS``, made in one new process (``in_one_process``). One test launches
through Lightning's spawn launcher, so that a refusal is seen reaching the launching process too.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import lightning.pytorch as pl
import numpy as np
import pytest
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.utilities import CombinedLoader
import torch
from distributed_helpers import CallOutcomes, Outcome, RankCalls, shared_directory
from scenarios import TEST_PG_TIMEOUT, EveryThirdFirst, IndexDataset, LengthBuckets, trainer_kwargs
from torch.utils.data import BatchSampler, DataLoader
from torch.utils.data.distributed import DistributedSampler

import lightning_ddp_ext
from lightning_ddp_ext import CustomDDP
from lightning_ddp_ext.samplers import DistributedSamplerWrapper

# Every test that spawns ranks: a fresh port and no rank left behind (see conftest.spawn_job).
pytestmark = pytest.mark.usefixtures("spawn_job")

SIZE = 45  # odd, so 2 ranks need padding in "pad" mode and get uneven shares in "exact" mode

#: The runs made on the module's two ranks (see the module's docstring), filled in beside the tests that check them.
RANK_CALLS: RankCalls = {}
#: One-device runs, made one after another in one new process (``in_one_process``), filled in the same way.
ONE_PROCESS_CALLS: RankCalls = {}


class Embedder(pl.LightningModule):
    """Embeds each sample and gathers each loader's embeddings at the end of validation, into ``report``."""

    def __init__(self, log_per_batch_in: Optional[str] = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 3)
        self.log_per_batch_in = log_per_batch_in  # "step", "batch_end" or None
        self.outputs: List[List[torch.Tensor]] = [[], [], []]  # one list per loader of loaders()
        self.report: Dict[int, Dict[str, Any]] = {}

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, _ = batch
        embedding = self.net(x)
        self.outputs[dataloader_idx].append(embedding)
        if self.log_per_batch_in == "step":
            self.log("norm", embedding.norm(), on_step=True, sync_dist=True)

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.log_per_batch_in == "batch_end":  # a per-batch hook: runs a different number of times per rank too
            self.log("norm_at_end", torch.tensor(1.0), on_step=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        strategy = self.trainer.strategy
        for idx, outputs in enumerate(self.outputs):
            self.report[idx] = {
                "gathered": strategy.gather_in_order(torch.cat(outputs), dataloader_idx=idx),  # type: ignore
                "evaluated": strategy.evaluated_indices(idx),  # type: ignore[attr-defined]
                "rows_here": sum(len(o) for o in outputs),
            }


def embed_every_sample(model: Embedder) -> torch.Tensor:
    """Row i: the model's embedding of sample i, in one process, as a gather in dataset order must give it."""
    with torch.no_grad():
        return model.net(torch.stack([IndexDataset(SIZE)[i][0] for i in range(SIZE)]))


def rows(table: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
    return table[torch.tensor(list(indices), dtype=torch.long)]


def loaders() -> List[DataLoader]:
    data = IndexDataset(SIZE)
    return [
        DataLoader(data, batch_size=4),  # default sampler
        DataLoader(data, batch_sampler=LengthBuckets([(i * 5) % 13 for i in range(SIZE)], 5)),  # custom: 9 batches
        DataLoader(data, batch_size=4, shuffle=True),  # stays shuffled, as in Lightning (which warns)
    ]


def _validate_three_loaders(eval_mode: str, pad_to_world_size: bool) -> Dict[str, Any]:
    pl.seed_everything(3)  # the same weights on both ranks, and the seed of the shuffled loader
    model = Embedder()
    table = embed_every_sample(model)
    strategy = CustomDDP(timeout=TEST_PG_TIMEOUT, eval_mode=eval_mode, pad_to_world_size=pad_to_world_size)
    pl.Trainer(strategy=strategy, **trainer_kwargs()).validate(model, loaders())
    return {"table": table, "report": model.report}


# pad_to_world_size concerns training: evaluation still pads
EVAL_MODES = [("pad", True), ("exact", True), ("pad", False)]
RANK_CALLS.update({f"three loaders, {m}, {p}": (_validate_three_loaders, (m, p)) for m, p in EVAL_MODES})


@pytest.mark.parametrize("eval_mode,pad_to_world_size", EVAL_MODES)
def test_gathered_embeddings_equal_single_process_in_dataset_order(
    on_two_ranks: CallOutcomes, eval_mode: str, pad_to_world_size: bool
) -> None:
    results = on_two_ranks.returned(f"three loaders, {eval_mode}, {pad_to_world_size}")
    for idx in range(3):
        for result in results:
            assert torch.allclose(result["report"][idx]["gathered"], results[0]["table"], atol=1e-6)
        evaluated = [i for result in results for i in result["report"][idx]["evaluated"]]
        assert sorted(evaluated) == list(range(SIZE))  # each sample once, padding excluded
        rows_here = [result["report"][idx]["rows_here"] for result in results]
        if eval_mode == "exact":
            assert sum(rows_here) == SIZE  # no sample evaluated twice
        else:
            assert rows_here[0] == rows_here[1] and sum(rows_here) > SIZE  # equal step counts, padding repeats


class UnchangedByTraining(pl.LightningModule):
    """A training step and an optimizer that leaves the weights as they are: for fits that are about validation."""

    net: torch.nn.Module

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class CombinedEmbedder(UnchangedByTraining, Embedder):
    """Validates a non-sequential CombinedLoader: every step holds a batch of each loader (None once one ran out).
    Also keeps which samples each loader's steps saw (``seen``), and trains (for a fit's sanity check)."""

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.seen: Dict[int, List[int]] = getattr(self, "seen", {idx: [] for idx in range(len(batch))})
        for idx, part in enumerate(batch):
            if part is not None:
                super().validation_step(part, batch_idx, idx)
                self.seen[idx] += part[1].tolist()


def _validate_combined(mode: str, run: str) -> Dict[str, Any]:
    torch.manual_seed(0)  # the same weights on both ranks
    model = CombinedEmbedder()
    table = embed_every_sample(model)
    strategy = CustomDDP(timeout=TEST_PG_TIMEOUT)
    combined = CombinedLoader(loaders(), mode=mode)
    if run == "sanity":  # only the sanity check validates: 5 steps, as far as the shortest share (not 6)
        options = dict(max_epochs=1, limit_train_batches=1, num_sanity_val_steps=6, check_val_every_n_epoch=2)
        pl.Trainer(strategy=strategy, **trainer_kwargs(**options)).fit(model, loaders()[0], combined)
    else:  # "limited": limits 3, 2 and 3 batches, but the loaders step together for 3 steps
        limit = 0.5 if run == "limited" else 1.0
        pl.Trainer(strategy=strategy, **trainer_kwargs(limit_val_batches=limit)).validate(model, combined)
    return {"table": table, "report": model.report, "seen": model.seen}


COMBINED_RUNS = [
    ("max_size", "whole"), ("min_size", "whole"), ("max_size", "limited"), ("min_size", "sanity"),
    ("max_size_cycle", "whole"),
]
RANK_CALLS.update({f"combined, {mode}, {run}": (_validate_combined, (mode, run)) for mode, run in COMBINED_RUNS})


@pytest.mark.parametrize("mode,run", COMBINED_RUNS)
def test_gather_in_order_per_loader_of_a_combined_loader_stepping_its_loaders_together(
    on_two_ranks: CallOutcomes, mode: str, run: str
) -> None:
    """Lightning counts such steps under loader 0 only (and not at all in the sanity check), and a limit only
    shortens the run; each loader's own count must still check and gather its values: all of every loader in
    "max_size" (the shorter ones run out first), as far as the shortest went in "min_size". "max_size_cycle"
    repeats the shorter loaders: refused by name."""
    outcomes = on_two_ranks[f"combined, {mode}, {run}"]
    if mode == "max_size_cycle":
        for outcome in outcomes:
            outcome.raised("cannot follow an evaluation CombinedLoader in mode 'max_size_cycle'")
        return
    results = [outcome.returned() for outcome in outcomes]
    for idx in range(3):
        evaluated = sorted(set(results[0]["seen"][idx] + results[1]["seen"][idx]))
        if run == "whole":  # "min_size": 5 steps, all of loader 1's 9 batches, 5 of 6 of the others'
            assert (evaluated == list(range(SIZE))) == (mode == "max_size" or idx == 1), idx
        else:
            assert 0 < len(evaluated) <= SIZE, idx
        for result in results:
            assert torch.allclose(result["report"][idx]["gathered"], rows(result["table"], evaluated), atol=1e-6), idx


class CarelessEmbedder(UnchangedByTraining, Embedder):
    """Gathers the outputs of its one loader as asked, into ``reports`` (one per validation run): ``"per_batch"``
    forgets ``torch.cat``, ``"skipped_batch"`` records nothing for batch 0, ``"sanity"`` gathers during the sanity
    check of a fit, ``"two_epochs"`` after each of two validation runs of a fit, ``"user_dealt"`` from a loader its
    ``val_dataloader`` dealt itself (and ``"user_dealt_unreplaced"`` the same under
    ``Trainer(use_distributed_sampler=False)``), ``"user_batched"`` from one it dealt by index and batched with
    torch's plain ``BatchSampler`` given as ``batch_sampler=``, ``"user_sharded"`` from one with that
    ``BatchSampler`` over torch's ``DistributedSampler``, ``"dataloader_iter"`` from a step that reads two batches
    from the loader's iterator, ``"zero_dim"`` with rank 1's values a 0-dim tensor, ``"as_dict"`` with rank 1's
    values a dict (which did not even slice)."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.reports: List[Dict[str, Any]] = []

    def val_dataloader(self) -> DataLoader:
        if self.case == "shared":  # one loader, dealt by its user, for training and validation
            if not hasattr(self, "shared"):
                self.shared = lightning_ddp_ext.patch_dataloader_to_ddp(loaders()[1])
            return self.shared
        if self.case == "user_batched":
            dealt = DistributedSamplerWrapper(EveryThirdFirst(SIZE), even_shares=False)
            return DataLoader(IndexDataset(SIZE), batch_sampler=BatchSampler(dealt, batch_size=4, drop_last=False))
        if self.case == "user_sharded":
            sharded = DistributedSampler(IndexDataset(SIZE), shuffle=False)
            return DataLoader(IndexDataset(SIZE), batch_sampler=BatchSampler(sharded, batch_size=4, drop_last=False))
        return lightning_ddp_ext.patch_dataloader_to_ddp(loaders()[1], even_shares=False)  # as the guide shows

    def train_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if not (self.case == "skipped_batch" and batch_idx == 0):
            super().validation_step(batch, batch_idx, dataloader_idx)

    def on_validation_epoch_end(self) -> None:
        outputs, self.outputs[0] = self.outputs[0], []
        values = outputs if self.case == "per_batch" else torch.cat(outputs)
        if self.case == "zero_dim" and self.global_rank == 1:
            values = values[0, 0]  # one rank's values squeezed down to a 0-dim tensor, which has no len()
        if self.case == "as_dict" and self.global_rank == 1:
            values = {"embedding": values}
        if self.case == "as_generator" and self.global_rank == 1:
            values = (row for row in values)  # iterable, but without the len() the strategy checks counts with
        strategy: Any = self.trainer.strategy
        self.reports.append({"gathered": strategy.gather_in_order(values), "evaluated": strategy.evaluated_indices()})


class TwoBatchesAStep(CarelessEmbedder):
    def validation_step(self, dataloader_iter: Any) -> None:  # type: ignore[override]
        for _ in range(2):
            try:
                x, _ = next(dataloader_iter)[0]
            except StopIteration:
                return
            self.outputs[0].append(self.net(x))


def _gather_carelessly(case: str) -> Dict[str, Any]:
    torch.manual_seed(0)  # the same weights on both ranks
    model = (TwoBatchesAStep if case == "dataloader_iter" else CarelessEmbedder)(case)
    table = embed_every_sample(model)
    loader = loaders()[1]  # LengthBuckets: 9 batches, 5 on rank 0 and 4 on rank 1 in "exact" mode
    plain = DataLoader(IndexDataset(SIZE), batch_size=4)
    strategy = CustomDDP(timeout=TEST_PG_TIMEOUT, eval_mode="exact")
    if case == "shared":
        pl.Trainer(strategy=strategy, **trainer_kwargs(max_epochs=1)).fit(model)
    elif case in ("sanity", "two_epochs"):
        fit_options = dict(max_epochs=2, limit_val_batches=2) if case == "two_epochs" else dict(
            max_epochs=1, num_sanity_val_steps=2, check_val_every_n_epoch=2
        )
        trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(limit_train_batches=1, **fit_options))
        trainer.fit(model, loader, plain if case == "two_epochs" else loader)
    else:
        unreplaced = {"use_distributed_sampler": False} if case == "user_dealt_unreplaced" else {}
        trainer = pl.Trainer(
            strategy=strategy, **trainer_kwargs(limit_val_batches=2 if case == "limited" else 1.0, **unreplaced)
        )
        if case in ("user_dealt", "user_dealt_unreplaced", "user_batched", "user_sharded"):
            trainer.validate(model)
        else:
            trainer.validate(model, loader)
    return {"table": table, "reports": model.reports}


GATHER_CASES = [
    ("per_batch", "values looks like per-batch outputs: torch.cat them"),
    ("skipped_batch", "from every batch, in the order the batches came"),
    ("limited", None),
    ("sanity", None),
    ("two_epochs", None),
    ("user_dealt", None),
    ("user_dealt_unreplaced", None),
    ("user_batched", None),
    ("user_sharded", None),
    ("dataloader_iter", None),
    ("shared", "is a training loader too, so it does not keep what it yields"),
    ("zero_dim", "rank 1: gather_in_order needs values with a sample dimension, got a 0-dim tensor"),
    ("as_dict", "rank 1: gather_in_order: values must be a tensor whose first dim runs over samples or a sequence"),
    ("as_generator", r"rank 1: gather_in_order: values must be .* a sequence \(with len\(\)\) .* got generator"),
]
RANK_CALLS.update({f"gather, {case}": (_gather_carelessly, (case,)) for case, _ in GATHER_CASES})


@pytest.mark.parametrize("case,error", GATHER_CASES)
def test_strategy_gather_checks_values_against_the_evaluated_batches(
    on_two_ranks: CallOutcomes, case: str, error: Optional[str]
) -> None:
    """The strategy knows how many batches each rank evaluated in this run, so values that do not cover them (a
    per-batch list, a batch left out) fail on every rank instead of being filed under the wrong indices; fewer
    batches than dealt (limit_val_batches, the sanity check, a later validation run of a fit, whose counts
    Lightning adds up) gather what they evaluated. A rank's own wrong values (a 0-dim tensor, a dict) are found
    before the exchange, and raised on every rank; a training epoch's share is not kept: an error that says so."""
    outcomes = on_two_ranks[f"gather, {case}"]
    if error is not None:
        if case in ("per_batch", "skipped_batch"):
            error = f"got .* values for evaluation loader 0, but this rank evaluated .*{error}"
        for outcome in outcomes:
            outcome.raised(error)
        return
    results = [outcome.returned() for outcome in outcomes]
    runs = 2 if case == "two_epochs" else 1  # validation runs
    batches_a_run = {"limited": 2, "sanity": 2, "two_epochs": 2}.get(case, 5)  # that a rank evaluates in each
    dealt = [list(b) for b in loaders()[1].batch_sampler]
    for run in range(runs):
        if case == "two_epochs":  # a default sampler deals samples: rank r takes r, r + 2, ..., 4 to a batch
            owns = [list(range(r, SIZE, 2))[: 4 * batches_a_run] for r in range(2)]
        elif case in ("user_batched", "user_sharded"):  # rank r takes positions r, r + 2, ... of the order, all
            order = list(EveryThirdFirst(SIZE)) if case == "user_batched" else list(range(SIZE))
            owns = [order[r::2] for r in range(2)]
        else:  # batches r, r + 2, ... (exact mode: no padding)
            owns = [[i for batch in dealt[r::2][:batches_a_run] for i in batch] for r in range(2)]
        # The loader may have yielded more than was evaluated (prefetching): those are left out, unless a
        # dataloader_iter step hides the count.
        for rank, own in enumerate(owns):
            got = results[rank]["reports"][run]["evaluated"]
            assert (got[: len(own)] if case == "dataloader_iter" else got) == own, (run, rank)
        for result in results:
            expected = rows(result["table"], sorted(owns[0] + owns[1]))
            assert torch.allclose(result["reports"][run]["gathered"], expected, atol=1e-6)


class GathersEveryBatch(Embedder):
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.trainer.strategy.gather_in_order(torch.cat(self.outputs[0]))  # type: ignore[attr-defined]


def _gather_inside_a_batch() -> None:
    trainer = pl.Trainer(strategy=CustomDDP(timeout=TEST_PG_TIMEOUT, eval_mode="exact"), **trainer_kwargs())
    trainer.validate(GathersEveryBatch(), loaders()[1])


RANK_CALLS["gather inside a batch"] = (_gather_inside_a_batch, ())


def test_gather_in_order_inside_an_exact_evaluation_batch_is_refused(on_two_ranks: CallOutcomes) -> None:
    """Ranks evaluate different numbers of batches in "exact" mode: a gather in a batch hook would pair rank 0's
    extra batch with another rank's next collective."""
    for outcome in on_two_ranks["gather inside a batch"]:
        outcome.raised("gather_in_order\\(\\) was called inside a validation/test batch")


def _log_per_step(strategy_class: str, where: str) -> None:
    strategy = getattr(lightning_ddp_ext, strategy_class)(timeout=TEST_PG_TIMEOUT, eval_mode="exact")
    pl.Trainer(strategy=strategy, **trainer_kwargs()).validate(Embedder(log_per_batch_in=where), loaders()[0])


# The sharded strategy has a training step of its own.
PER_STEP_LOGGING = [("CustomDDP", "step"), ("CustomDDP", "batch_end"), ("CustomDDPSharded", "step")]
RANK_CALLS.update({f"log per step, {name}, {at}": (_log_per_step, (name, at)) for name, at in PER_STEP_LOGGING})


@pytest.mark.parametrize("strategy_class,where", PER_STEP_LOGGING)
def test_exact_mode_refuses_per_step_collectives_instead_of_hanging(
    on_two_ranks: CallOutcomes, strategy_class: str, where: str
) -> None:
    if strategy_class == "CustomDDPSharded":
        pytest.importorskip("fairscale")
    for outcome in on_two_ranks[f"log per step, {strategy_class}, {where}"]:
        outcome.raised("inside a validation/test batch.*per-step collective would hang")


def test_eval_mode_and_shuffle_window_are_validated_at_construction() -> None:
    """Before launch, in the process that builds the strategy, not in every rank once its loaders are set up."""
    with pytest.raises(ValueError, match="eval_mode must be 'pad' or 'exact'"):
        CustomDDP(eval_mode="uneven")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CustomDDP: shuffle_window must be None or an integer >= 1, got 0"):
        CustomDDP(shuffle_batches_between_ranks=True, shuffle_window=0)
    for flag in ("shuffle_batches_between_ranks", "pad_to_world_size", "check_sampler_consistency"):
        with pytest.raises(ValueError, match=f"CustomDDP: {flag} must be True or False, got 'no'"):
            CustomDDP(**{flag: "no"})  # truthy: it padded, shuffled, checked
        with pytest.raises(ValueError, match=f"CustomDDP: {flag} must be True or False, got None"):
            CustomDDP(**{flag: None})  # falsy
        assert getattr(CustomDDP(**{flag: np.bool_(False)}), flag) is False


class GatherAtEpochStart(pl.LightningModule):
    """Trains, and gathers at the start of every validation epoch: outside any step, so allowed in "exact" mode."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.gathered: List[List[float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_validation_epoch_start(self) -> None:
        self.gathered.append(self.all_gather(torch.tensor(float(self.global_rank))).tolist())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


def _fit_gathering_at_epoch_start() -> List[List[float]]:
    trainer = pl.Trainer(
        strategy=CustomDDP(timeout=TEST_PG_TIMEOUT, eval_mode="exact"),
        **trainer_kwargs(reload_dataloaders_every_n_epochs=1),
    )
    model = GatherAtEpochStart()
    trainer.fit(model, DataLoader(IndexDataset(8), batch_size=2), DataLoader(IndexDataset(5)))
    return model.gathered


RANK_CALLS["gather at epoch start"] = (_fit_gathering_at_epoch_start, ())


def test_exact_mode_allows_collectives_outside_the_steps_during_fit(on_two_ranks: CallOutcomes) -> None:
    """An epoch-start all_gather, and the barrier Lightning runs when it reloads the loaders, are not refused."""
    for outcome in on_two_ranks["gather at epoch start"]:
        assert outcome.returned() == [[0.0, 1.0]] * 2


class MeanLogger(pl.LightningModule):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        self.log("mean", x.mean(), on_step=False, on_epoch=True, sync_dist=True, batch_size=len(x))

    test_step = validation_step


def _validate_mean_of_three() -> float:
    trainer = pl.Trainer(strategy=CustomDDP(timeout=TEST_PG_TIMEOUT, eval_mode="exact"), **trainer_kwargs())
    [metrics] = trainer.validate(MeanLogger(), DataLoader(IndexDataset(3), batch_size=4), verbose=False)
    return metrics["mean"]


RANK_CALLS["mean of three"] = (_validate_mean_of_three, ())


def test_exact_mode_sync_dist_mean_weighs_every_sample_once(on_two_ranks: CallOutcomes) -> None:
    """3 samples in batches of 4: rank 0 evaluates 2, rank 1 one; the logged mean is that of the 3 samples."""
    data = IndexDataset(3)
    for outcome in on_two_ranks["mean of three"]:
        assert outcome.returned() == pytest.approx(sum(float(data[i][0]) for i in range(3)) / 3)


class FailingOnce(MeanLogger):
    """Raises in its first validation step while ``fail`` is set."""

    fail = True

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.fail:
            raise KeyError("the user's own error")
        super().validation_step(batch, batch_idx)


def _validate_exactly_after_a_failed_batch() -> Tuple[str, bool, Dict[str, float], torch.dtype]:
    """What the failed run raised and whether its checkpoint exists; the next run's metrics and its mean's dtype."""
    checkpoint = OnExceptionCheckpoint(str(shared_directory("exact after a failed batch")))
    model, loader = FailingOnce(), DataLoader(IndexDataset(6), batch_size=4)
    trainer = pl.Trainer(
        strategy=CustomDDP(eval_mode="exact"),
        **trainer_kwargs(devices=1, callbacks=[checkpoint], enable_checkpointing=True),
    )
    try:
        trainer.validate(model, loader)
        raised = "nothing"
    except Exception as error:
        raised = f"{type(error).__name__}: {error}"
    saved = Path(checkpoint.ckpt_path).exists()
    model.fail = False
    [metrics] = trainer.validate(model, loader, verbose=False)  # the same Trainer: its barriers are allowed
    return raised, saved, metrics, trainer.callback_metrics["mean"].dtype


ONE_PROCESS_CALLS["exact after a failed batch"] = (_validate_exactly_after_a_failed_batch, ())


def test_exact_mode_after_a_failed_batch_leaves_lightning_s_collectives_alone(
    in_one_process: Dict[str, Outcome]
) -> None:
    """A batch that raised is never counted complete. Lightning's exception handling (OnExceptionCheckpoint's
    save, with its barrier) and the next run on the same Trainer (its loader set-up barrier) must not be taken
    for collectives inside a batch. One process: the check is the same, the run is cheap."""
    raised, saved, metrics, dtype = in_one_process["exact after a failed batch"].returned()
    assert raised == "KeyError: \"the user's own error\"", raised  # not a RuntimeError from the save's barrier
    assert saved
    data = IndexDataset(6)
    assert metrics["mean"] == pytest.approx(sum(float(data[i][0]) for i in range(6)) / 6)
    assert dtype == torch.float32  # the integer counts' mean is float, not float64


def test_exact_mode_refuses_a_loader_that_leaves_a_rank_without_batches() -> None:
    """Through Lightning's spawn launcher: the refusal reaches the process that launched the ranks."""
    strategy = CustomDDP(start_method="spawn", timeout=TEST_PG_TIMEOUT, eval_mode="exact")
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs())
    with pytest.raises(
        Exception, match="leaves rank 1 without a batch.*fewer ranks, a smaller batch size, or eval_mode='pad'"
    ):
        trainer.validate(MeanLogger(), DataLoader(IndexDataset(1), batch_size=4))


def _limit_to_a_fraction(stage: str, setting: str) -> None:
    strategy = CustomDDP(timeout=TEST_PG_TIMEOUT, eval_mode="exact")
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(**{setting: 0.4}))
    getattr(trainer, stage)(MeanLogger(), DataLoader(IndexDataset(5), batch_size=1))


LIMITS = [("validate", "limit_val_batches"), ("test", "limit_test_batches")]
RANK_CALLS.update({f"fraction, {stage}": (_limit_to_a_fraction, (stage, setting)) for stage, setting in LIMITS})


@pytest.mark.parametrize("stage,setting", LIMITS)
def test_exact_mode_refuses_a_fraction_of_batches_that_leaves_a_rank_none(
    on_two_ranks: CallOutcomes, stage: str, setting: str
) -> None:
    """5 samples dealt exactly, a batch each: 3 and 2. A limit of 0.4 takes 1 of rank 0's and none of rank 1's,
    where Lightning raised alone (its MisconfigurationException) while rank 0 went on: now every rank raises. The
    error names the stage's own setting."""
    for outcome in on_two_ranks[f"fraction, {stage}"]:
        outcome.raised(
            rf"{setting}=0.4 of the {stage} loader's batches leaves rank 1, which is dealt 2, none .*\(an int\)"
        )


class ValidatesOnAnUnevenUserDeal(MeanLogger):
    """Validates on a loader its user dealt by index with ``even_shares=False`` (7 samples: 4 and 3), batched by
    torch's plain BatchSampler dropping the last partial batch of 4, which leaves rank 1 without a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.allow_zero_length_dataloader_with_multiple_devices = True  # else Lightning refuses the empty rank

    def val_dataloader(self) -> DataLoader:
        dealt = DistributedSamplerWrapper(EveryThirdFirst(7), even_shares=False)
        return DataLoader(IndexDataset(7), batch_sampler=BatchSampler(dealt, batch_size=4, drop_last=True))


def _validate_on_an_uneven_user_deal() -> None:
    pl.Trainer(strategy=CustomDDP(timeout=TEST_PG_TIMEOUT), **trainer_kwargs()).validate(ValidatesOnAnUnevenUserDeal())


RANK_CALLS["uneven user deal"] = (_validate_on_an_uneven_user_deal, ())


def test_a_user_deal_that_leaves_a_rank_without_batches_is_refused_too(on_two_ranks: CallOutcomes) -> None:
    """The rank with no batch would skip validation and leave the others' epoch-end collectives (the consistency
    check among them) unpaired: refused on every rank alike, naming the user's option."""
    for outcome in on_two_ranks["uneven user deal"]:
        outcome.raised(
            r"DistributedSamplerWrapper\(even_shares=False\): .* leaves rank 1 without a batch.*or even_shares=True"
        )


class StepsTogetherAndFails(UnchangedByTraining):
    """Validates a "min_size" CombinedLoader, gathering each loader's rows; ``fail_at`` raises inside validation."""

    def __init__(self, fail_at: Optional[int] = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.fail_at = fail_at
        self.gathered: List[int] = []

    def on_validation_epoch_start(self) -> None:
        self.rows: List[List[torch.Tensor]] = [[], []]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.fail_at:
            raise KeyError("interrupted inside validation")
        for idx, (x, _) in enumerate(batch):
            self.rows[idx].append(self.net(x))

    def on_validation_epoch_end(self) -> None:
        strategy: Any = self.trainer.strategy
        self.gathered = [
            len(strategy.gather_in_order(torch.cat(rows), dataloader_idx=idx)) for idx, rows in enumerate(self.rows)
        ]


def _fit_combined(model: StepsTogetherAndFails, ckpt_path: Optional[str] = None, **options: Any) -> None:
    trainer = pl.Trainer(
        strategy=CustomDDP(), **trainer_kwargs(devices=1, max_epochs=1, limit_train_batches=2, **options)
    )
    loaders = [DataLoader(IndexDataset(24), batch_size=4), DataLoader(IndexDataset(16), batch_size=4)]
    train = DataLoader(IndexDataset(8), batch_size=4)
    trainer.fit(model, train, CombinedLoader(loaders, "min_size"), ckpt_path=ckpt_path)


def _resume_inside_a_combined_validation() -> Tuple[str, List[int]]:
    """What the interrupted fit raised, and the row counts the resumed fit gathered per loader."""
    checkpoint = OnExceptionCheckpoint(str(shared_directory("combined validation, interrupted")))
    try:
        _fit_combined(StepsTogetherAndFails(fail_at=2), callbacks=[checkpoint], enable_checkpointing=True)
        raised = "nothing"
    except Exception as error:
        raised = f"{type(error).__name__}: {error}"
    resumed = StepsTogetherAndFails()
    _fit_combined(resumed, ckpt_path=checkpoint.ckpt_path)
    return raised, resumed.gathered


ONE_PROCESS_CALLS["combined validation, resumed"] = (_resume_inside_a_combined_validation, ())


def test_gather_in_order_of_a_combined_validation_resumed_from_inside_it(in_one_process: Dict[str, Outcome]) -> None:
    """A fit resumed from a checkpoint written inside validation runs only the rest of it, while Lightning's
    count of the run's steps starts at the steps done before: the count must not take those as this run's."""
    raised, gathered = in_one_process["combined validation, resumed"].returned()
    assert raised == "KeyError: 'interrupted inside validation'", raised
    assert gathered == [8, 8], gathered  # Lightning runs the 2 steps left, from the start: 8 rows
