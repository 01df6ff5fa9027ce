"""Reliability with real processes: faults, resume, and two "nodes" on one machine.

* Faults: a rank that raises, or is SIGKILLed, mid-epoch ends the whole job with an error (the original one
  visible) instead of a hang, for the spawn launcher (inside pytest) and the popen launcher (a script).
* Resume: an end-of-epoch checkpoint resumes exactly; a mid-epoch one replays what Lightning replays.
* Multi-node: 2 nodes x 1 process through torchrun and through plain environment variables, on 127.0.0.1.

Every run uses a 20 s process-group timeout, a fresh port, a bounded wait, and ends with a check that none of
its processes is left (popen jobs run in their own session; spawn ranks are children of this process).
"""
from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import lightning.pytorch as pl
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from packaging.version import Version
import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from reliability_common import (  # noqa: E402
    INJECTED_MESSAGE,
    PG_TIMEOUT_S,
    STARTUP_SLACK_S,
    FaultyRecorder,
    PKBatches,
    WeightRecorder,
    describe,
    free_port,
    job_env,
    kill_session,
    labels_for,
    pk_loader,
    read_json,
    session_members,
    strategy,
    trainer_kwargs,
    wait_until,
)

from distributed_helpers import run_python  # noqa: E402

from lightning_ddp_ext import DistributedBatchSamplerWrapper  # noqa: E402
from lightning_ddp_ext.sharded import fairscale_available  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"
needs_fairscale = pytest.mark.skipif(not fairscale_available(), reason='needs pip install "lightning_ddp_ext[sharded]"')
WORLD = 2
JOB_TIMEOUT_S = PG_TIMEOUT_S + STARTUP_SLACK_S  # bounded wait for one job; the test fails past it
TEST_TIMEOUT_S = 2 * JOB_TIMEOUT_S  # pytest-timeout, per test: the job, the orphan check, the clean-up


# ------------------------------------------------------------------------------------------------ helpers
def start_job(command: Sequence[str], out: Path, env: Dict[str, str], name: str = "job") -> subprocess.Popen:
    """Start a job in its own session (so that every process it starts can be found and killed)."""
    with open(out / f"{name}.log", "wb") as sink:
        return subprocess.Popen(
            list(command), stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=str(out), start_new_session=True
        )


def finish_jobs(
    jobs: Dict[str, subprocess.Popen], out: Path, grace_s: float = PG_TIMEOUT_S + 30
) -> Dict[str, Tuple[int, str]]:
    """Wait (bounded) for every job and for every process of its session; kill whatever is left in any case.

    Returns each job's exit status and log. Fails the test when a job outlives ``JOB_TIMEOUT_S`` or leaves a
    process behind for longer than ``grace_s`` after its first process exited.
    """
    try:
        for name, job in jobs.items():
            try:
                job.wait(timeout=JOB_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(
                    f"{name} did not finish within {JOB_TIMEOUT_S}s; its processes:\n"
                    f"{describe(session_members(job.pid))}\n{tail(out / f'{name}.log')}"
                )
        for name, job in jobs.items():
            if not wait_until(lambda: not session_members(job.pid), grace_s):
                left = describe(session_members(job.pid))
                pytest.fail(f"{name} left processes behind:\n{left}\n{tail(out / f'{name}.log')}")
    finally:
        for job in jobs.values():
            kill_session(job.pid)
            job.wait(timeout=30)
    return {name: (job.returncode, (out / f"{name}.log").read_text(errors="replace")) for name, job in jobs.items()}


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def batches_by_epoch(report: Dict[str, Any], key: str = "train/only") -> Dict[int, List[List[int]]]:
    by_epoch: Dict[int, List[List[int]]] = {}
    for epoch, indices in report["seen"][key]:
        by_epoch.setdefault(epoch, []).append(indices)
    return by_epoch


def expected_shares(size: int, sampler_seed: int, epoch: int, shuffle_seed: int) -> List[List[List[int]]]:
    """What each rank must train on in ``epoch``: the user's sequence dealt out, computed in this process."""
    shares = []
    for rank in range(WORLD):
        wrapper = DistributedBatchSamplerWrapper(
            PKBatches(labels_for(size), p=2, k=4, seed=sampler_seed), num_replicas=WORLD, rank=rank,
            shuffle=True, seed=shuffle_seed,
        )
        wrapper.set_epoch(epoch)
        shares.append([list(b) for b in wrapper])
    return shares


def assert_partition(shares: List[List[List[int]]], size: int, sampler_seed: int, epoch: int) -> None:
    """The ranks' batches together are exactly the user's sequence for the epoch (here no padding: 2 | len)."""
    user = PKBatches(labels_for(size), p=2, k=4, seed=sampler_seed)
    user.set_epoch(epoch)
    sequence = sorted(tuple(b) for b in user)
    assert sorted(tuple(b) for share in shares for b in share) == sequence, f"epoch {epoch}: not a partition"
    assert len({len(share) for share in shares}) == 1, "ranks ran different numbers of steps"


def load_weights(run_dir: Path, rank: int) -> Dict[str, torch.Tensor]:
    return torch.load(run_dir / f"weights_rank{rank}.pt", weights_only=True)


def assert_same_weights(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs: max |diff| {(a[key] - b[key]).abs().max().item():.3g}"


# ------------------------------------------------------------------------------------------------ faults
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("fault,fault_rank", [("raise", 1), ("raise_exiting_late", 1), ("sigkill", 0)])
def test_spawn_a_failing_rank_ends_the_whole_job(fault: str, fault_rank: int, tmp_path: Path, spawn_job: None) -> None:
    """The error raised is the failing rank's, also when another rank, failing because of it, exits first
    (torch.multiprocessing reports the first process to exit: "raise_exiting_late" makes that the survivor)."""
    trainer = pl.Trainer(strategy=strategy("spawn"), **trainer_kwargs(max_epochs=3))
    model = FaultyRecorder(str(tmp_path), fault=fault, fault_rank=fault_rank, fault_step=2)
    with pytest.raises(Exception) as raised:
        trainer.fit(model, pk_loader(size=96))
    assert (tmp_path / f"rank{fault_rank}.fault").exists(), "the fault was never reached"
    message = str(raised.value)
    if fault.startswith("raise"):
        assert f"{INJECTED_MESSAGE} on rank {fault_rank} at step 2" in message, message[-2000:]
        assert isinstance(raised.value, ProcessRaisedException) and raised.value.error_index == fault_rank
    if fault == "raise_exiting_late" and f"Process {1 - fault_rank} failed after it" not in message:
        # The survivor should fail once the failing rank's exit handler has destroyed the group; on torch 2.6 it
        # was seen failing only after that rank had ended, which leaves the launcher nothing to choose.
        assert Version(torch.__version__.split("+")[0]) < Version("2.13"), message[-2000:]
        pytest.skip(
            f"torch {torch.__version__}: the failing rank exited first, so the launcher's choice was not tested"
        )
    elif fault == "sigkill":
        # the launcher reports the killed rank, or the survivor's error about its dead peer, whichever it saw first
        assert "SIGKILL" in message or "Connection" in message, message[-2000:]
    assert not list(tmp_path.glob("rank*.json")), "a rank finished training"


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("fault,fault_rank", [("raise", 1), ("sigkill", 0)])
def test_popen_a_failing_rank_ends_the_whole_job(fault: str, fault_rank: int, tmp_path: Path) -> None:
    """strategy="ddp_custom_sampler": rank 0 is the script, rank 1 the launcher's re-run of it.

    Killing rank 0 also kills Lightning's child-process observer, so rank 1 must end by itself: the gloo
    connection to its dead peer breaks, or the process-group timeout expires.
    """
    command = [sys.executable, str(SCRIPTS / "reliability_fault.py"), str(tmp_path), fault, str(fault_rank), "2"]
    (code, log), = finish_jobs({"job": start_job(command, tmp_path, job_env())}, tmp_path).values()
    assert code != 0, log[-3000:]
    assert (tmp_path / f"rank{fault_rank}.fault").exists(), log[-3000:]
    if fault == "raise":
        assert f"{INJECTED_MESSAGE} on rank {fault_rank} at step 2" in log, log[-3000:]
    else:
        survivor = tmp_path / f"rank{1 - fault_rank}.error"
        assert survivor.exists(), f"the surviving rank did not fail by itself:\n{log[-3000:]}"
        assert "RuntimeError" in survivor.read_text(), survivor.read_text()[-2000:]
    assert not list(tmp_path.glob("rank*.json")), "a rank finished training"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_popen_rank0_failing_ends_a_rank_stuck_outside_collectives(tmp_path: Path) -> None:
    """Rank 1 hangs outside any collective (as a rank does whose DataLoader worker deadlocked at fork); rank 0
    fails at the process-group timeout. Lightning's popen launcher kills the other ranks only when a *child*
    fails (or on Ctrl+C); CustomDDP.on_exception ends it, or it would run on, orphaned, forever."""
    command = [sys.executable, str(SCRIPTS / "reliability_fault.py"), str(tmp_path), "hang", "1", "2"]
    (code, log), = finish_jobs({"job": start_job(command, tmp_path, job_env())}, tmp_path, grace_s=10).values()
    assert code != 0, log[-3000:]
    assert (tmp_path / "rank1.fault").exists() and (tmp_path / "rank0.error").exists(), log[-3000:]


# ------------------------------------------------------------------------------------------------ resume
RESUME_SIZE, RESUME_SAMPLER_SEED, RESUME_SHUFFLE_SEED = 96, 1, 11  # as in scripts/reliability_resume.py
STEPS_PER_EPOCH, MID_EPOCH_DONE = 6, 2  # 12 batches over 2 ranks; the step-8 checkpoint is 2 steps into epoch 1


def run_resume_script(out: Path, workers: int) -> Dict[str, Any]:
    command = [sys.executable, str(SCRIPTS / "reliability_resume.py"), str(out), str(workers)]
    (code, log), = finish_jobs({"job": start_job(command, out, job_env())}, out).values()
    assert code == 0, log[-4000:]
    runs = ("two_epochs", "resumed", "resumed_reloading", "uninterrupted", "resumed_mid_epoch")
    return {
        run: {
            "reports": [read_json(out / run / f"rank{r}.json") for r in range(WORLD)],
            "weights": [load_weights(out / run, r) for r in range(WORLD)],
        }
        for run in runs
    }


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    return run_resume_script(tmp_path_factory.mktemp("resume"), workers=0)


@pytest.fixture(scope="module")
def resume_runs_with_workers(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    return run_resume_script(tmp_path_factory.mktemp("resume_workers"), workers=1)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_resume_from_an_epoch_end_checkpoint_matches_the_uninterrupted_run(resume_runs: Dict[str, Any]) -> None:
    resumed, uninterrupted = resume_runs["resumed"], resume_runs["uninterrupted"]
    expected = expected_shares(RESUME_SIZE, RESUME_SAMPLER_SEED, 2, RESUME_SHUFFLE_SEED)
    for rank in range(WORLD):
        theirs, ours = batches_by_epoch(uninterrupted["reports"][rank]), batches_by_epoch(resumed["reports"][rank])
        assert list(ours) == [2], "the resumed fit must run epoch 2 (the third) only"
        assert ours[2] == theirs[2] == expected[rank]
        assert resumed["reports"][rank]["facts"]["epochs_set"]["only"] == [2]  # once, though set twice
        # Also when reload_dataloaders_every_n_epochs sets the loader up again as the resumed epoch starts (each
        # set-up wraps the user's sampler anew): it was given epoch 2 by both.
        reloading = resume_runs["resumed_reloading"]["reports"][rank]
        assert reloading["facts"]["epochs_set"]["only"] == [2] and batches_by_epoch(reloading)[2] == theirs[2]
        assert_same_weights(resumed["weights"][rank], uninterrupted["weights"][rank])
    for epoch in range(3):
        assert_partition([batches_by_epoch(uninterrupted["reports"][r])[epoch] for r in range(WORLD)],
                         RESUME_SIZE, RESUME_SAMPLER_SEED, epoch)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_mid_epoch_resume_continues_where_the_checkpoint_was_taken(resume_runs: Dict[str, Any]) -> None:
    """Lightning 2.x resumes a mid-epoch checkpoint by running the steps left in the epoch, but restarts a torch
    DataLoader (not resumable) at the epoch's start: batches 0-1 would train twice and 4-5 never. CustomDDP
    skips the batches trained before the checkpoint, so the resumed run equals the uninterrupted one."""
    resumed, uninterrupted = resume_runs["resumed_mid_epoch"], resume_runs["uninterrupted"]
    # Lightning without restart stages (2.2) re-runs the batch whose on_train_batch_end wrote the checkpoint
    # (with any sampler), and counts it in the epoch's steps: the skip leaves it in, or the epoch would end a
    # batch short of Lightning's count (no epoch-end validation, no last step).
    done = MID_EPOCH_DONE - (0 if hasattr(_TrainingEpochLoop, "restarted_on_train_batch_end") else 1)
    for rank in range(WORLD):
        theirs, ours = batches_by_epoch(uninterrupted["reports"][rank]), batches_by_epoch(resumed["reports"][rank])
        assert sorted(ours) == [1, 2]
        assert ours[1] == theirs[1][done:], "batches 0-1 of the epoch trained twice, 4-5 never"
        assert ours[2] == theirs[2]
        assert resumed["reports"][rank]["facts"]["epochs_set"]["only"] == [1, 2]  # each epoch forwarded once
        if done == MID_EPOCH_DONE:
            assert_same_weights(resumed["weights"][rank], uninterrupted["weights"][rank])
    said = resumed["reports"][0]["facts"]["info"]
    assert any(f"skips the {done} batch(es) of epoch 1 trained before the checkpoint" in line for line in said), said


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_resume_with_loader_workers_trains_the_resumed_epoch(resume_runs_with_workers: Dict[str, Any]) -> None:
    """Lightning creates the training iterator before it calls set_epoch; with num_workers > 0 the iterator
    draws its first indices at once, so the first resumed epoch would replay epoch 0 (Lightning issue #21938);
    CustomDDP sets the epoch while it shards the loader, before the iterator exists."""
    resumed, uninterrupted = resume_runs_with_workers["resumed"], resume_runs_with_workers["uninterrupted"]
    for rank in range(WORLD):
        ours = batches_by_epoch(resumed["reports"][rank])[2]
        theirs = batches_by_epoch(uninterrupted["reports"][rank])
        assert ours != theirs[0], "the resumed epoch 2 replayed epoch 0's batches"
        assert ours == theirs[2]
        assert_same_weights(resumed["weights"][rank], uninterrupted["weights"][rank])


# scripts/reliability_resume_edges.py checkpoints its user_dealt and estimating runs 2 steps into epoch 1
USER_DEALT_DONE = 2


@pytest.fixture(scope="module")
def resume_edge_runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, List[Dict[str, Any]]]:
    out = tmp_path_factory.mktemp("resume_edges")
    command = [sys.executable, str(SCRIPTS / "reliability_resume_edges.py"), str(out)]
    (code, log), = finish_jobs({"job": start_job(command, out, job_env())}, out).values()
    assert code == 0, log[-4000:]
    runs = ("limited", "limited_first", "limited_resumed", "limited_resumed_with_workers", "cycled", "cycled_first",
            "cycled_resumed", "ended_by_max_steps", "ended_by_max_steps_first", "ended_by_max_steps_resumed",
            "ended_by_max_steps_resumed_by_epochs", "ended_reshuffled", "ended_reshuffled_first",
            "ended_reshuffled_resumed", "ended_reshuffled_reloading", "ended_reshuffled_again",
            "ended_reshuffled_again_resumed", "grown", "grown_first", "grown_resumed", "grown_again",
            "grown_again_resumed", "grown_stale", "grown_validated", "grown_validated_first", "grown_validated_resumed",
            "grown_hooked", "grown_hooked_first", "grown_hooked_resumed", "grown_beside", "grown_late", "unsized",
            "sized", "sized_first", "sized_resumed", "user_dealt", "user_dealt_first", "user_dealt_resumed",
            "user_batched", "user_batched_first", "user_batched_resumed", "estimating", "estimating_first",
            "estimating_resumed", "early", "early_first", "early_resumed",
            "user_sharded", "user_sharded_first", "user_sharded_resumed", "user_sharded_batched",
            "user_sharded_batched_first", "user_sharded_batched_resumed", "shared_resumed",
            "validating", "validating_resumed", "stateful", "stateful_first", "stateful_resumed",
            "stateful_early_resumed", "stateful_estimating_resumed", "stateful_streams", "stateful_streams_first",
            "stateful_streams_resumed", "stateful_streams_reloaded", "stateful_streams_reloaded_first",
            "stateful_streams_reloaded_resumed", "generator_resumed", "generator_early_resumed",
            "generator_cycled_resumed", "generator_cycled_estimating_resumed", "generator_cycled_early_resumed",
            "early_own_optimizers_resumed", "own_optimizers_resumed", "stateful_mixed",
            "stateful_mixed_first", "stateful_mixed_resumed", "stateful_streams_on_fit_start_resumed",
            "stateful_used_trainer")
    return {run: [read_json(out / run / f"rank{r}.json") for r in range(WORLD)] for run in runs}


EDGE_CASES = [
    ("limited", "resumed", ["only"]),
    ("limited", "resumed_with_workers", ["only"]),
    ("cycled", "resumed", ["a", "b", "c"]),
    ("ended_by_max_steps", "resumed", ["only"]),
    ("ended_reshuffled", "resumed", ["only"]),
    ("ended_reshuffled", "reloading", ["only"]),
    ("grown", "resumed", ["only"]),
    ("grown_validated", "resumed", ["only"]),
    ("grown_hooked", "resumed", ["only"]),
    ("stateful", "resumed", ["only"]),
    ("sized", "resumed", ["a", "b", "c"]),
    ("user_dealt", "resumed", ["only"]),
    ("user_sharded", "resumed", ["only"]),
    ("estimating", "resumed", ["only"]),
    ("early", "resumed", ["only"]),
    ("stateful", "early_resumed", ["only"]),
    ("user_batched", "resumed", ["only"]),
    ("user_sharded_batched", "resumed", ["only"]),
    ("stateful_streams", "resumed", ["stream"]),
    ("stateful_streams_reloaded", "resumed", ["dealt", "stream"]),
    ("stateful", "estimating_resumed", ["only"]),
    ("stateful_mixed", "resumed", ["s", "plain"]),
    ("stateful_streams", "on_fit_start_resumed", ["stream"]),
]


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("run,resumed,loaders", EDGE_CASES, ids=[f"{run}-{resumed}" for run, resumed, _ in EDGE_CASES])
def test_resumes_at_the_edges_of_an_epoch_continue_as_the_uninterrupted_run(
    resume_edge_runs: Dict[str, List[Dict[str, Any]]], run: str, resumed: str, loaders: List[str]
) -> None:
    """A checkpoint at the last batch of an epoch that limit_train_batches shortens: Lightning starts the next
    epoch when it resumes, which must be trained whole (its first batches were skipped, as if the resume were
    inside it), also by a loader with workers, whose iterator reads the sampler as soon as it is made. A loader
    that CombinedLoader restarts ("max_size_cycle") resumes inside its current pass; one that ran out in mode
    "max_size" yields nothing more. A loader its user dealt (with our wrapper, or torch's DistributedSampler),
    with a worker, resumes like one CustomDDP dealt, also when its batch_sampler= is a plain BatchSampler over
    our index wrapper; so does one Lightning sets up before it restores the
    checkpoint's loops (for a configure_optimizers that reads estimated_stepping_batches), and one it sets up
    before it even loads the checkpoint (for a setup hook that reads it). A StatefulDataLoader restores its own
    position (Lightning loads its state, also when set up in the setup hook), so the sampler must not skip its
    batches again. max_steps ending a fit inside an epoch still runs the epoch-end hooks, where ModelCheckpoint
    writes a checkpoint that is processed but not completed: resumed with max_steps, Lightning goes on with the
    rest of that epoch, in which the sampler's first batches must not be trained again. A checkpoint at the last
    batch of an epoch followed by a longer one (a curriculum growing through set_epoch) resumes with that epoch,
    trained whole (Lightning alone would go on from the restored position, training only its first batches)."""
    if run in ("user_sharded", "user_sharded_batched", "stateful_mixed") and not hasattr(
        _TrainingEpochLoop, "restarted_on_train_batch_end"
    ):
        pytest.skip(
            "this Lightning (no restart stages in its training epoch loop, as in 2.2) re-runs the batch whose"
            " on_train_batch_end wrote the checkpoint, so its resumed epoch trains one batch more than the"
            " uninterrupted run, with any sampler (a stateful loader beside a plain one goes on where it was)"
        )
    # Lightning without restart stages (2.2) re-runs the batch whose on_train_batch_end wrote the checkpoint,
    # except from a stateful loader, which goes on after the last batch it yielded.
    rerun = 0 if run.startswith("stateful") or hasattr(_TrainingEpochLoop, "restarted_on_train_batch_end") else 1
    rerun = 0 if run.startswith("ended") or run == "grown_validated" else rerun  # written after the batch's hooks
    for rank in range(WORLD):
        for loader in loaders:
            key = f"train/{loader}"
            whole = resume_edge_runs[run][rank]["seen"][key]
            first = resume_edge_runs[f"{run}_first"][rank]["seen"][key]
            parts = first[: len(first) - rerun] + resume_edge_runs[f"{run}_{resumed}"][rank]["seen"][key]
            assert parts == whole, f"rank {rank}, loader {loader}: interrupted and resumed {parts} != {whole}"
    said = {  # "b" ran out before the checkpoint (3 or, with a rerun, 2 steps done of its 2 batches)
        "cycled": f"mode 'max_size_cycle' it restarted when it ran out, so it skips the {1 - rerun} batch(es)",
        "sized": "mode 'max_size' it ran out before the checkpoint, so it yields nothing more this epoch",
        "user_dealt": f"skips the {USER_DEALT_DONE - rerun} batch(es) of epoch 1 trained before the checkpoint",
        "estimating": f"skips the {USER_DEALT_DONE - rerun} batch(es) of epoch 1 trained before the checkpoint",
        "user_batched": f"skips the {USER_DEALT_DONE - rerun} batch(es) of epoch 1 trained before the checkpoint",
        "early": f"skips the {USER_DEALT_DONE - rerun} batch(es) of epoch 1 trained before the checkpoint",
        "ended_by_max_steps": "skips the 3 batch(es) of epoch 0",  # which Lightning 2.6 calls epoch 1 in set_epoch
        "ended_reshuffled": "skips the 3 batch(es) of epoch 0",
        # Lightning 2.2 runs the restored epoch's last batch again: the sampler deals it, after the 3 before it.
        "grown": (
            "the next epoch has 6 and is trained from its first" if not rerun else "skips the 3 batch(es) of epoch 1"
        ),
    }.get(run)
    if said is not None:
        info = resume_edge_runs[f"{run}_resumed"][0]["facts"]["info"]
        assert any(said in line for line in info), info
    if run in ("estimating", "early"):  # the iterator is made once after the restore, or not again: one skip
        assert sum(said in line for line in info) == 1, info


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_sampler_growing_with_the_epoch_without_reloading_loaders_gets_a_warning_naming_the_fix(
    resume_edge_runs: Dict[str, List[Dict[str, Any]]]
) -> None:
    """Lightning counts an epoch's batches when it sets the training loaders up: a curriculum whose epochs grow
    through set_epoch trains each epoch's first batches only (2 of 2, 4 and 6 per rank), unless the loaders are
    set up again every epoch. CustomDDP says so, once, with the numbers; with reloading it says nothing, nor when
    the growing loader stays shorter than another one, which sets the epoch's length (all of it is trained).
    Grown in on_train_epoch_start, after Lightning read the length, it loses batches even with reloading: the
    warning then says where to make the change instead. A loader without a length (a stream) is not measured."""
    def said(run: str) -> List[str]:
        warnings = resume_edge_runs[run][0]["facts"]["warnings"]
        return [w for w in warnings if "Lightning counted the epoch's batches when it set the loaders up" in w]

    stale, late = resume_edge_runs["grown_stale"], resume_edge_runs["grown_late"]
    for rank in range(WORLD):
        per_epoch = [epoch for epoch, _ in stale[rank]["seen"]["train/only"]]
        assert per_epoch == [0, 0, 1, 1, 2, 2], per_epoch  # Lightning's behaviour, which the warning names
        assert [epoch for epoch, _ in late[rank]["seen"]["train/only"]] == [0, 0, 1, 1, 2, 2, 2, 2]
        reloaded = [epoch for epoch, _ in resume_edge_runs["grown"][rank]["seen"]["train/only"]]
        assert reloaded == [0] * 2 + [1] * 4 + [2] * 6, reloaded
        beside = resume_edge_runs["grown_beside"][rank]["seen"]["train/b"]  # cycled to a's 8 batches each epoch
        distinct = [len({tuple(batch) for epoch, batch in beside if epoch == e}) for e in range(3)]
        assert distinct == [2, 4, 6], distinct  # all of b every epoch
    (stale_said,), (late_said,) = said("grown_stale"), said("grown_late")
    assert "Growing has 4 batches per rank in epoch 1" in stale_said and "takes 2" in stale_said, stale_said
    assert "reload_dataloaders_every_n_epochs=1" in stale_said, stale_said
    assert "GrowsWhenTold has 4 batches per rank in epoch 1" in late_said and "takes 2" in late_said, late_said
    assert "in on_train_epoch_start" in late_said and "set_epoch" in late_said, late_said
    assert not said("grown") and not said("grown_beside")
    assert [len(resume_edge_runs["unsized"][rank]["seen"]["train/only"]) for rank in range(WORLD)] == [4, 4]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_fit_ended_by_max_steps_and_resumed_twice_with_a_reshuffling_sampler_trains_as_the_uninterrupted_run(
    resume_edge_runs: Dict[str, List[Dict[str, Any]]]
) -> None:
    """Resumed from the epoch-end checkpoint of a fit that max_steps ended, Lightning 2.3+ passes set_epoch one
    more than the epoch it runs, for the rest of the ended epoch and every epoch after: a sampler reshuffling per
    epoch trained the rest in the next epoch's order (never training the ended epoch's last batches, nor the
    next epoch's first), and each later epoch in the order of the one after it. Interrupted again inside the
    next epoch and resumed, the run still trains what the uninterrupted one did."""
    # Lightning without restart stages (2.2) re-runs the batch whose on_train_batch_end wrote the second checkpoint,
    # as one more step: max_steps then ends the resumed fit one batch early.
    rerun = 0 if hasattr(_TrainingEpochLoop, "restarted_on_train_batch_end") else 1
    for rank in range(WORLD):
        whole = resume_edge_runs["ended_reshuffled"][rank]["seen"]["train/only"]
        again = resume_edge_runs["ended_reshuffled_again"][rank]["seen"]["train/only"]
        parts = (
            resume_edge_runs["ended_reshuffled_first"][rank]["seen"]["train/only"]
            + again[: len(again) - rerun]
            + resume_edge_runs["ended_reshuffled_again_resumed"][rank]["seen"]["train/only"]
        )
        assert parts == whole[: len(whole) - rerun], f"rank {rank}: interrupted twice and resumed {parts} != {whole}"
    info = resume_edge_runs["ended_reshuffled_again_resumed"][0]["facts"]["info"]
    assert any(f"skips the {2 - rerun} batch(es) of epoch 1 trained" in line for line in info), info


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_fit_resumed_after_an_epochs_last_batch_and_interrupted_again_trains_as_the_uninterrupted_run(
    resume_edge_runs: Dict[str, List[Dict[str, Any]]]
) -> None:
    """Resumed from a checkpoint written at an epoch's last batch, Lightning 2.3+ went on with the next epoch
    without starting it (no on_train_epoch_start, its started count not raised): a checkpoint written inside that
    epoch said it was done, and resumed from it, the epoch ran again from its first batch. Interrupted there and
    resumed, the run now trains what the uninterrupted one did."""
    # Lightning without restart stages (2.2) re-runs the batch whose on_train_batch_end wrote each checkpoint.
    rerun = 0 if hasattr(_TrainingEpochLoop, "restarted_on_train_batch_end") else 1
    for rank in range(WORLD):
        runs = [resume_edge_runs[run][rank]["seen"]["train/only"] for run in ("grown_first", "grown_again")]
        parts = [batch for seen in runs for batch in seen[: len(seen) - rerun]]
        parts += resume_edge_runs["grown_again_resumed"][rank]["seen"]["train/only"]
        whole = resume_edge_runs["grown"][rank]["seen"]["train/only"]
        assert parts == whole, f"rank {rank}: interrupted twice and resumed {parts} != {whole}"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_fit_ended_by_max_steps_and_resumed_by_epochs_trains_the_next_epoch_whole(
    resume_edge_runs: Dict[str, List[Dict[str, Any]]]
) -> None:
    """Resumed without max_steps from the epoch-end checkpoint of a fit that max_steps ended inside its first
    epoch, Lightning counts that epoch as done and starts the next: nothing of it is skipped."""
    for rank in range(WORLD):
        whole = resume_edge_runs["ended_by_max_steps"][rank]["seen"]["train/only"]
        resumed = resume_edge_runs["ended_by_max_steps_resumed_by_epochs"][rank]["seen"]["train/only"]
        assert [batch for _, batch in resumed] == [batch for epoch, batch in whole if epoch == 1], rank
    info = resume_edge_runs["ended_by_max_steps_resumed_by_epochs"][0]["facts"]["info"]
    assert not any("resuming mid-epoch" in line for line in info), info


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_fit_resumed_by_epochs_after_one_stopped_inside_an_epoch_warns_that_its_rest_is_not_trained(
    resume_edge_runs: Dict[str, List[Dict[str, Any]]]
) -> None:
    """The checkpoint ModelCheckpoint writes when a fit stops inside an epoch (max_steps here; a Timer, max_time or
    EarlyStopping leave the same progress) counts the epoch as processed: resumed by max_epochs alone, Lightning
    starts the next epoch and the rest of that one is never trained, with any strategy. CustomDDP says so, once,
    with the numbers and what to do; nothing else warns of it: not a fit resumed with max_steps (Lightning goes on
    with the rest), nor one from an epoch that limit_train_batches ended, nor any other resume."""
    def said(run: str) -> List[str]:
        return [w for w in resume_edge_runs[run][0]["facts"]["warnings"] if "the fit stopped inside epoch" in w]

    (warning,) = said("ended_by_max_steps_resumed_by_epochs")
    assert "stopped inside epoch 0, 3 batch(es) into it on each rank" in warning, warning
    assert "Lightning starts epoch 1: the rest of epoch 0 is not trained" in warning, warning
    assert "resume with max_steps set" in warning and "every_n_train_steps" in warning, warning
    others = [run for run in resume_edge_runs if run != "ended_by_max_steps_resumed_by_epochs" and said(run)]
    assert not others, others


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_training_loader_set_up_in_the_setup_hook_is_dealt_as_usual_and_resumes_without_a_warning(
    resume_edge_runs: Dict[str, List[Dict[str, Any]]]
) -> None:
    """Reading trainer.estimated_stepping_batches in the LightningModule's setup hook sets the train loader up
    before the strategy's setup: the custom batch sampler must be dealt as usual (Lightning's own sampler
    replacement, not yet turned off, would raise that it cannot inject a sampler into it). Its resume is
    prepared once the loops are restored (test_resumes_at_the_edges_of_an_epoch_continue_as_the_uninterrupted_run
    [early-resumed-loaders8]), so nothing warns that it could not be."""
    for rank in range(WORLD):
        early, usual = (resume_edge_runs[run][rank] for run in ("early", "estimating"))
        assert early["seen"]["train/only"] == usual["seen"]["train/only"], f"rank {rank} was dealt otherwise"
    for run in ("early", "early_resumed", "stateful_early_resumed", "generator_early_resumed"):
        warned = resume_edge_runs[run][0]["facts"]["warnings"]
        assert not any("set up before the checkpoint" in line for line in warned), warned
    # A one-shot iterable has nothing to prepare, and is not iterated again (its first iterator drew a batch).
    for rank in range(WORLD):
        early, usual = (resume_edge_runs[run][rank]["seen"] for run in ("generator_early_resumed", "generator_resumed"))
        assert early == usual, f"rank {rank}: {early} != {usual}"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_training_loaders_that_cannot_be_prepared_again_are_left_as_set_up_and_a_warning_says_so(
    resume_edge_runs: Dict[str, List[Dict[str, Any]]]
) -> None:
    """Beside a generator, which cannot start again, the training iterator is not made again: loaders set up in
    configure_optimizers (already at the checkpoint's position) resume as set up, with no skip left over for the
    dealt loader's next pass; loaders set up in the setup hook cannot be, and a warning says why. So does one for a
    strategy whose Lightning never calls load_optimizer_state_dict."""
    for rank in range(WORLD):
        estimating, usual = (
            resume_edge_runs[f"generator_cycled_{run}"][rank]["seen"] for run in ("estimating_resumed", "resumed")
        )
        assert estimating == usual, f"rank {rank}: {estimating} != {usual}"
    said = {
        "generator_cycled_early_resumed": "could not be prepared for it: a training loader is an iterator",
        "early_own_optimizers_resumed": "could not be prepared for it: load_optimizer_state_dict was not called",
    }
    for run, reason in said.items():
        warned = resume_edge_runs[run][0]["facts"]["warnings"]
        assert sum(reason in line for line in warned) == 1, warned
    for run in ("generator_cycled_estimating_resumed", "own_optimizers_resumed"):  # nothing to prepare again
        assert not any("could not be prepared" in line for line in resume_edge_runs[run][0]["facts"]["warnings"])


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_trainer_whose_resumed_fit_had_no_step_left_prepares_the_next_resumed_fit(
    resume_edge_runs: Dict[str, List[Dict[str, Any]]]
) -> None:
    """Lightning leaves the fit loop restarting after a resumed fit with no step left; a later fit on the same
    Trainer, resumed at step 2, still prepares the loaders its configure_optimizers sets up before the restore."""
    for rank in range(WORLD):
        whole, used = (
            resume_edge_runs[run][rank]["seen"]["train/only"] for run in ("stateful", "stateful_used_trainer")
        )
        assert used == whole[2:4], f"rank {rank}: {used} != {whole[2:4]}"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_loader_serving_training_and_validation_is_not_left_with_a_resume_skip(
    resume_edge_runs: Dict[str, List[Dict[str, Any]]]
) -> None:
    """A fit resumed mid-epoch with no step left sets up a skip for its training loader that no training reads;
    the validation after it, and a later fit that leaves loaders as given (so nothing prepares this one), on the
    same loader its user keeps, must still read its whole share."""
    for rank in range(WORLD):
        validated = resume_edge_runs["shared_resumed"][rank]["seen"]["val/only"]
        assert len(validated) == 6, f"rank {rank} validated {len(validated)} of its 6 batches"
        trained = resume_edge_runs["shared_resumed"][rank]["seen"]["train/only"]
        assert [epoch for epoch, _ in trained] == [0] * 6, f"rank {rank} trained {trained}, not its 6 batches"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_fit_resumed_in_validation_skips_in_training_not_in_the_validation_it_finishes(
    resume_edge_runs: Dict[str, List[Dict[str, Any]]]
) -> None:
    """A checkpoint written in the step of a mid-epoch validation's first batch: the resumed fit runs that
    validation first, whole, on the loader it shares with training, which must not take the skip of the 2
    batches trained before it."""
    for rank in range(WORLD):
        whole, resumed = (resume_edge_runs[run][rank]["seen"] for run in ("validating", "validating_resumed"))
        assert resumed["train/only"] == whole["train/only"][2:], f"rank {rank}: trained {resumed['train/only']}"
        assert resumed["val/only"] == whole["val/only"], f"rank {rank}: validated {resumed['val/only']}"


# ------------------------------------------------------------------------------------------------ resume, other world
OTHER_WORLD_BATCHES, OTHER_WORLD_STEP = 12, 3  # as in scripts/reliability_resume_other_world.py
# The batches of each rank Lightning counts as done at the step-3 checkpoint: without restart stages (2.2) it
# re-runs the batch whose on_train_batch_end wrote the checkpoint (with any sampler), and does not count it.
OTHER_WORLD_DONE = OTHER_WORLD_STEP - (0 if hasattr(_TrainingEpochLoop, "restarted_on_train_batch_end") else 1)
OTHER_WORLD_TIMEOUT_S = 2 * TEST_TIMEOUT_S  # two jobs, one after the other


def run_other_world_script(out: Path, first: int, resumed: int) -> Dict[str, Any]:
    """Phase ``first`` on ``first`` ranks, then phase ``resumed`` on ``resumed``: each rank's report per run."""
    for phase, devices in (("first", first), ("resumed", resumed)):
        command = [sys.executable, str(SCRIPTS / "reliability_resume_other_world.py"), str(out), phase, str(devices)]
        (code, log), = finish_jobs({phase: start_job(command, out, job_env(), phase)}, out).values()
        assert code == 0, log[-4000:]
    ranks = {"first": first, "first_shuffled": first, "resumed": resumed, "resumed_shuffled": resumed,
             "resumed_legacy": resumed}
    runs: Dict[str, Any] = {run: [read_json(out / run / f"rank{r}.json") for r in range(n)] for run, n in ranks.items()}
    return {**runs, "out": out}


@pytest.fixture(scope="module")
def one_to_two(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    return run_other_world_script(tmp_path_factory.mktemp("one_to_two"), 1, 2)


@pytest.fixture(scope="module")
def two_to_one(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    return run_other_world_script(tmp_path_factory.mktemp("two_to_one"), 2, 1)


def resume_warnings(report: Dict[str, Any]) -> List[str]:
    return [line for line in report["facts"]["warnings"] if "resuming mid-epoch from a checkpoint that" in line]


@pytest.mark.timeout(OTHER_WORLD_TIMEOUT_S)
def test_a_mid_epoch_checkpoint_of_one_rank_resumes_on_two_right_after_the_batches_it_trained(
    one_to_two: Dict[str, Any]
) -> None:
    """One rank trained batches 0-2 of 12 before the checkpoint (2.2 counts 0-1, see OTHER_WORLD_DONE). On two
    ranks, each skips done // 2 batches of its share: they start at batch 2, not at 2 * done (which would never
    train batches 3-5). Lightning runs the 6 - done steps left in its count, so the last batches go untrained,
    and a warning says how many."""
    done = OTHER_WORLD_DONE
    expected = {3: [[[2], [4], [6]], [[3], [5], [7]]], 2: [[[2], [4], [6], [8]], [[3], [5], [7], [9]]]}[done]
    for rank in range(2):
        trained = batches_by_epoch(one_to_two["resumed"][rank])
        assert trained[0] == expected[rank], f"rank {rank}"
        assert trained[1] == [[i] for i in range(rank, OTHER_WORLD_BATCHES, 2)], f"rank {rank}"
    trained_before, skip, twice, untrained, in_all = {3: (3, 1, 1, 2, 4), 2: (2, 1, 0, 1, 2)}[done]
    said = resume_warnings(one_to_two["resumed"][0])
    assert len(said) == 1, one_to_two["resumed"][0]["facts"]["warnings"]
    assert (
        f"checkpoint that 1 rank(s) wrote, on 2: they trained the first {trained_before} batch(es) of epoch 0"
        f" ({done} each), so each rank skips its first {skip} batch(es) of the epoch, and {twice} batch(es) are"
        f" trained twice. Lightning goes on counting the epoch's steps from the checkpoint's {done}, so each rank's"
        f" last {untrained} batch(es) of epoch 0 ({in_all} in all) are not trained." in said[0]
    ), said
    assert "approximate" not in said[0]
    assert not any("does not apply" in line for line in one_to_two["resumed"][0]["facts"]["info"])


@pytest.mark.timeout(OTHER_WORLD_TIMEOUT_S)
def test_a_mid_epoch_checkpoint_of_two_ranks_resumes_on_one_training_each_batch_left_once(
    two_to_one: Dict[str, Any]
) -> None:
    """Two ranks trained batches 0 to 2 * done - 1 before the checkpoint; one rank trains all the others, once
    each, and the epoch ends when its loader runs out (before Lightning's count of steps)."""
    done = OTHER_WORLD_DONE
    before = [b for rank in range(2) for b in batches_by_epoch(two_to_one["first"][rank])[0][:done]]
    trained = batches_by_epoch(two_to_one["resumed"][0])
    assert trained[0] == [[i] for i in range(2 * done, OTHER_WORLD_BATCHES)]
    assert sorted(before + trained[0]) == [[i] for i in range(OTHER_WORLD_BATCHES)], "a batch skipped or repeated"
    assert trained[1] == [[i] for i in range(OTHER_WORLD_BATCHES)]
    said = resume_warnings(two_to_one["resumed"][0])
    assert len(said) == 1, two_to_one["resumed"][0]["facts"]["warnings"]
    assert (
        f"checkpoint that 2 rank(s) wrote, on 1: they trained the first {2 * done} batch(es) of epoch 0 ({done}"
        f" each), so each rank skips its first {2 * done} batch(es) of the epoch, and 0 batch(es) are trained"
        " twice. Lightning goes on counting the epoch's steps from the checkpoint's"
        f" {done}, so the epoch ends early, when the loader runs out, and no batch of it is left untrained." in said[0]
    ), said
    assert not any("does not apply" in line for line in two_to_one["resumed"][0]["facts"]["info"])


@pytest.mark.timeout(OTHER_WORLD_TIMEOUT_S)
@pytest.mark.parametrize("runs,old,new", [("one_to_two", 1, 2), ("two_to_one", 2, 1)])
def test_a_shuffled_mid_epoch_resume_on_another_number_of_ranks_skips_as_unshuffled_and_says_it_is_approximate(
    request: pytest.FixtureRequest, runs: str, old: int, new: int
) -> None:
    """The same number of this rank's batches is skipped as without shuffling, of this number of ranks' dealt
    order (shuffle_window=2: windows of 2 * W batches), which differs from the order the checkpoint's ranks
    trained in: the warning says the skip is approximate."""
    reports, done = request.getfixturevalue(runs)["resumed_shuffled"], OTHER_WORLD_DONE
    skip = done * old // new
    for rank in range(new):
        wrapper = DistributedBatchSamplerWrapper(
            [[i] for i in range(OTHER_WORLD_BATCHES)], num_replicas=new, rank=rank, shuffle=True, seed=11,
            shuffle_window=2,
        )
        share = [list(b) for b in wrapper]
        assert batches_by_epoch(reports[rank])[0] == share[skip:][: len(share) - done], f"rank {rank}"
    said = resume_warnings(reports[0])
    assert len(said) == 1 and f"so each rank skips its first {skip} batch(es)" in said[0], said
    assert "the skip is approximate, some batches of this epoch are trained twice and others not at all" in said[0]


@pytest.mark.timeout(OTHER_WORLD_TIMEOUT_S)
@pytest.mark.parametrize("runs,old,new", [("one_to_two", 1, 2), ("two_to_one", 2, 1)])
def test_checkpoints_record_the_number_of_ranks_and_load_as_lightning_checkpoints(
    request: pytest.FixtureRequest, runs: str, old: int, new: int, tmp_path: Path
) -> None:
    """The number of ranks is a top-level key that LightningModule.load_from_checkpoint ignores. A checkpoint
    without it (an earlier version's) resumes as before: each rank skips the checkpoint's count of its batches."""
    results = request.getfixturevalue(runs)
    path = results["out"] / "checkpoints" / "first" / f"step={OTHER_WORLD_STEP}.ckpt"
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    assert checkpoint["lightning_ddp_ext"] == {"world_size": old}
    model = WeightRecorder.load_from_checkpoint(path, out_dir=str(tmp_path))
    assert_same_weights(model.state_dict(), checkpoint["state_dict"])
    done = OTHER_WORLD_DONE
    for rank in range(new):
        trained = batches_by_epoch(results["resumed_legacy"][rank])[0]
        assert trained == [[i] for i in range(rank, OTHER_WORLD_BATCHES, new)][done:], f"rank {rank}"
    assert not resume_warnings(results["resumed_legacy"][0])
    said = f"skips the {done} batch(es) of epoch 0 trained before the checkpoint"
    assert any(said in line for line in results["resumed_legacy"][0]["facts"]["info"])


# ------------------------------------------------------------------------------------------------ multi-node
def node_commands(how: str, out: Path, port: int, *options: str) -> Dict[str, Tuple[List[str], Dict[str, str]]]:
    script = str(SCRIPTS / "reliability_multinode.py")
    commands = {}
    for node in range(2):
        if how == "torchrun":
            torchrun = str(Path(sys.executable).with_name("torchrun"))
            command = [torchrun, "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}",
                       "--master_addr=127.0.0.1", f"--master_port={port}", script, str(out), *options]
            env = job_env(port)
        else:
            command = [sys.executable, script, str(out), *options]
            env = job_env(port, NODE_RANK=str(node))  # the launcher sets WORLD_SIZE from num_nodes x devices
        commands[f"node{node}"] = (command, env)
    return commands


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("how,environment", [("torchrun", "TorchElasticEnvironment"), ("env", "LightningEnvironment")])
def test_two_nodes_on_one_machine_partition_the_data(how: str, environment: str, tmp_path: Path) -> None:
    jobs = {
        name: start_job(command, tmp_path, env, name)
        for name, (command, env) in node_commands(how, tmp_path, free_port()).items()
    }
    results = finish_jobs(jobs, tmp_path)
    for name, (code, log) in results.items():
        assert code == 0, f"{name}:\n{log[-4000:]}"
    reports = [read_json(tmp_path / f"rank{r}.json") for r in range(WORLD)]
    for rank, report in enumerate(reports):
        facts = report["facts"]
        assert (facts["global_rank"], facts["node_rank"], facts["world_size"]) == (rank, rank, WORLD)
        assert facts["cluster_environment"] == environment
    for epoch in range(2):
        shares = [batches_by_epoch(reports[r])[epoch] for r in range(WORLD)]
        assert shares == expected_shares(64, 1, epoch, 0)
        assert_partition(shares, 64, 1, epoch)
    assert_same_weights(load_weights(tmp_path, 0), load_weights(tmp_path, 1))  # one model across the nodes


#: Loader case of reliability_multinode.py -> what each rank's own error must say.
RANK_ERRORS = {
    # rank 1 fails while its loader is dealt; rank 0, already in the cross-rank length check, must raise at once
    # naming it: not a gloo error about a lost peer (rank 1's process ended), nor a timeout (it lives on, in a
    # notebook say)
    "empty-sampler-on-rank-1": [
        "rank 1 failed before it could compare its samplers with the other ranks (ValueError: list is empty",
        "list is empty (len() == 0): there is nothing to deal out among 2 ranks",
    ],
    # the same for a rank 0 that deals no loader at all (its loader is an IterableDataset): it still takes part
    "stream-on-rank-0-empty-sampler-on-rank-1": [
        "rank 1 failed before it could compare its samplers with the other ranks (ValueError: list is empty",
        "list is empty (len() == 0): there is nothing to deal out among 2 ranks",
    ],
    "stream-on-rank-0": ["the ranks' loaders differ: rank 0 deals nothing (a loader that is not dealt"] * WORLD,
    "unseeded": ["PKBatches does not produce the same sequence on every rank"] * WORLD,
    "length-by-rank": [
        "PKBatches does not produce the same sequence on every rank: len() is 8 on rank 0 but 9"
    ] * WORLD,
}


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("fault", sorted(RANK_ERRORS))
def test_sampler_faults_fail_on_every_rank_with_their_cause(fault: str, tmp_path: Path) -> None:
    """Two nodes, no launcher watching both, so each rank ends by itself: each must raise its own clear error
    before training (a Trainer test under spawn sees only the first rank's error; the launcher kills the rest)."""
    commands = node_commands("env", tmp_path, free_port(), "--loaders", fault)
    jobs = {name: start_job(command, tmp_path, env, name) for name, (command, env) in commands.items()}
    results = finish_jobs(jobs, tmp_path)
    for rank, expected in enumerate(RANK_ERRORS[fault]):
        code, log = results[f"node{rank}"]
        error_file = tmp_path / f"rank{rank}.error"
        assert code != 0 and error_file.exists(), f"rank {rank} did not fail:\n{log[-3000:]}"
        error = error_file.read_text()
        assert expected in error, f"rank {rank}:\n{error[-3000:]}"
        assert "Timed out" not in error and "Connection closed" not in error, f"rank {rank}:\n{error[-3000:]}"
    assert not list(tmp_path.glob("rank*.json")), "a rank trained"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_loaders_that_are_not_dealt_may_differ_in_class_between_ranks(tmp_path: Path) -> None:
    """They take part in the length check only to say that they are not dealt: each rank iterates its own."""
    commands = node_commands("env", tmp_path, free_port(), "--loaders", "streams-of-two-classes")
    jobs = {name: start_job(command, tmp_path, env, name) for name, (command, env) in commands.items()}
    for name, (code, log) in finish_jobs(jobs, tmp_path).items():
        assert code == 0, f"{name}:\n{log[-3000:]}"
    for rank in range(WORLD):
        assert len(read_json(tmp_path / f"rank{rank}.json")["seen"]["train/only"]) == 2 * 8  # 2 epochs of 8, whole


# ------------------------------------------------------------------------------------------------ exit
# Prints the names of a process's threads while a one-rank Gloo group is alive, then leaves at once.
_GLOO_THREAD_NAMES = """
import os, sys, torch, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
print(*(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")))
sys.stdout.flush()
os._exit(0)
"""


@functools.lru_cache(maxsize=None)
def gloo_names_its_threads() -> bool:
    """Whether this torch names Gloo's worker threads (``pt_gloo_runloop``): torch 2.13 does, 2.6 leaves them
    named after the process, so a check by name cannot see them there."""
    return "pt_gloo_runloop" in run_python("-c", _GLOO_THREAD_NAMES, timeout=60).stdout.split()


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc (Linux)")
@pytest.mark.parametrize(
    "kind",
    ["ddp", "ddp_zero", "ddp_zero_popen", "ddp_module_group", "ddp_failing", "ddp_own_init_popen"]
    + [pytest.param(kind, marks=needs_fairscale) for kind in ("sharded", "sharded_16_mixed", "sharded_16_mixed_popen")],
)
def test_ranks_leave_no_gloo_thread_to_interpreter_finalisation(kind: str, tmp_path: Path) -> None:
    """A Gloo group alive at interpreter finalisation keeps its worker threads, and one that takes the GIL then
    aborts the rank (SIGABRT, "terminate called without an active exception": rank 1 of a sharded "16-mixed" fit,
    in CI). Each piece of the exit clean-up has cases that fail without it:

    * CustomDDP's exit handler: ``ddp``; registered also when an override of ``init_ddp_connection`` makes the
      group without ``super()``: ``ddp_own_init_popen``;
    * its dropping of the finished spawn target's arguments (the trainer): ``ddp_module_group``, whose
      LightningModule keeps the default group;
    * each strategy letting go of the groups its model wrapper, optimizers and scaler hold: ``ddp_zero_popen``
      (torch's ZeroRedundancyOptimizer, in a script that keeps the trainer), ``ddp_failing`` (a rank that raised
      and never tore down its DDP wrapper), ``sharded_16_mixed_popen``; ``ddp_zero`` needs either of these two;
    * CustomDDPSharded importing fairscale and torch's ShardedGradScaler before the default group exists (their
      ``dist.group.WORLD`` default arguments held it): ``sharded``, ``sharded_16_mixed`` (and ``..._popen``
      for the scaler); and releasing the checkpoint guard's group: every sharded case.
    """
    if not gloo_names_its_threads():
        pytest.skip(f"torch {torch.__version__} leaves Gloo's threads unnamed: which are left at exit cannot be seen")
    run_python(str(SCRIPTS / "exit_threads.py"), str(tmp_path), kind, timeout=JOB_TIMEOUT_S)
    for rank in [1] if kind == "ddp_failing" else range(WORLD):  # rank 0 of a failed spawn job is terminated
        during = (tmp_path / f"during_rank{rank}.txt").read_text().split("\n")
        left = (tmp_path / f"exit_rank{rank}.txt").read_text().split("\n")
        assert "pt_gloo_runloop" in during, during  # the check sees Gloo's threads
        assert [name for name in left if "gloo" in name or "tcpstore" in name] == [], left
