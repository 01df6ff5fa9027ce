"""CustomDDP and CustomDDPSharded on a real CUDA device over NCCL (skipped where there is none).

The CPU tests check which backend and device ids the strategy would pick; these run them: one process on
one GPU (NCCL refuses two ranks on one device), as a subprocess so that its NCCL group ends with it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
from distributed_helpers import run_python
from scenarios import PKBatches, labels_for

from lightning_ddp_ext.sharded import fairscale_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SCRIPT = Path(__file__).parent / "scripts" / "gpu_fit.py"


def fit_on_the_gpu(out: Path, mode: str) -> Dict[str, Any]:
    run_python(str(SCRIPT), str(out), mode, timeout=300, cwd=out)
    facts: Dict[str, Any] = json.loads((out / "gpu_facts.json").read_text())
    facts["rank0"] = json.loads((out / "rank0.json").read_text())
    return facts


def trained_batches(facts: Dict[str, Any]) -> list:
    return [[epoch, indices] for epoch, indices in facts["rank0"]["seen"]["train/only"]]


def expected_batches() -> list:
    sampler = PKBatches(labels_for(), p=2, k=4, seed=1)
    batches = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches += [[epoch, batch] for batch in sampler]
    return batches


def test_custom_ddp_trains_on_a_gpu_over_nccl(tmp_path: Path) -> None:
    """NCCL for a CUDA root device, DDP built with the device's id and the parameters on it, the user's
    batch sampler dealt whole, and one gradient all-reduce per optimizer step (accumulating 2 batches)."""
    facts = fit_on_the_gpu(tmp_path, "ddp")
    assert facts["backend"] == "nccl" and facts["world_size"] == 1
    assert facts["wrapper"] == "DistributedDataParallel" and facts["device_ids"] == [0]
    assert facts["parameter_devices"] == ["cuda:0"]
    assert facts["batch_sampler"] == "DistributedBatchSamplerWrapper"
    assert trained_batches(facts) == expected_batches()  # one rank: every batch, unchanged, in order
    assert facts["global_step"] == len(expected_batches()) // 2
    assert facts["rank0"]["facts"]["allreduce_rounds"] == facts["global_step"]
    assert facts["rank0"]["facts"]["configure_ddp_override_used"] is True


@pytest.mark.skipif(not fairscale_available(), reason='needs pip install "lightning_ddp_ext[sharded]"')
def test_custom_ddp_sharded_trains_on_a_gpu_over_nccl(tmp_path: Path) -> None:
    """The sharded variant on the device: ShardedDataParallel over an OSS optimizer, on NCCL."""
    facts = fit_on_the_gpu(tmp_path, "sharded")
    assert facts["backend"] == "nccl" and facts["world_size"] == 1
    assert facts["wrapper"] == "ShardedDataParallel"
    assert "OSS" in facts["optimizer"]
    assert facts["parameter_devices"] == ["cuda:0"]
    assert trained_batches(facts) == expected_batches()
    assert facts["global_step"] == len(expected_batches()) // 2
