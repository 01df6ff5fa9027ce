"""Samplers, a dataset and a recording LightningModule shared by the Trainer tests and the popen script.

Module-level so that spawned ranks can unpickle them. Each rank writes what it saw to
``<out_dir>/rank<R>.json``, which the tests read back; a run on ranks started for many runs (``call_on_ranks``)
returns it instead (:func:`records`).
"""
from __future__ import annotations

import json
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler, SequentialSampler, TensorDataset

from lightning_ddp_ext import CustomDDP

#: Process-group timeout of the strategies tests build: a rank that hangs fails its test within a minute, with
#: the collective's timeout error, instead of at pytest's timeout (the default is 30 minutes).
TEST_PG_TIMEOUT = timedelta(seconds=60)

DATASET_SIZE = 48


class IndexDataset(Dataset):
    """Item i is (feature i, i), so a batch tells which dataset indices it came from."""

    def __init__(self, size: int = DATASET_SIZE) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([float(index % 7) / 7.0]), index


class PKBatches:
    """P classes x K samples per batch; subclasses nothing and takes no `sampler` argument."""

    def __init__(self, labels: List[int], p: int, k: int, seed: Optional[int] = 0) -> None:
        self.labels, self.p, self.k, self.seed = labels, p, k, seed
        self.epoch = 0
        self.epochs_set: List[int] = []
        self.by_class: Dict[int, List[int]] = {}
        for index, label in enumerate(labels):
            self.by_class.setdefault(label, []).append(index)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs_set.append(epoch)

    def __len__(self) -> int:
        return len(self.labels) // (self.p * self.k)

    def __iter__(self) -> Iterator[List[int]]:
        generator = torch.Generator()
        if self.seed is None:
            generator.seed()  # unseeded: a different draw on every rank
        else:
            generator.manual_seed(self.seed + self.epoch)
        classes = list(self.by_class)
        for _ in range(len(self)):
            chosen = torch.randperm(len(classes), generator=generator)[: self.p].tolist()
            batch: List[int] = []
            for c in chosen:
                members = self.by_class[classes[c]]
                picks = torch.randperm(len(members), generator=generator)[: self.k].tolist()
                batch.extend(members[i] for i in picks)
            yield batch


class LengthBuckets(BatchSampler):
    """A BatchSampler subclass with its own constructor (no `sampler`): Lightning cannot re-instantiate it."""

    def __init__(self, lengths: List[int], batch_size: int) -> None:
        self.lengths, self.bucket_size = lengths, batch_size

    def __iter__(self) -> Iterator[List[int]]:
        order = sorted(range(len(self.lengths)), key=lambda i: (self.lengths[i], i))
        return (order[i : i + self.bucket_size] for i in range(0, len(order), self.bucket_size))

    def __len__(self) -> int:
        return -(-len(self.lengths) // self.bucket_size)


class ReversedBlocks(BatchSampler):
    """A BatchSampler subclass with BatchSampler's constructor that ignores its sampler and builds batches itself.

    Lightning re-instantiates it with a DistributedSampler injected, which it then ignores: every rank
    trains on the same batches.
    """

    def __iter__(self) -> Iterator[List[int]]:
        size = len(self.sampler)  # type: ignore[arg-type]
        for start in reversed(range(0, size, self.batch_size)):
            yield list(range(start, min(start + self.batch_size, size)))


class EveryThirdFirst(Sampler[int]):
    """A custom index sampler: a fixed curriculum order."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(range(self.size), key=lambda i: (i % 3, i)))

    def __len__(self) -> int:
        return self.size


class DivergesAfter:
    """A batch sampler whose ranks agree on its first ``same`` batches and then draw different ones: as when a
    sampler draws lazily from a global RNG that each rank's data augmentation also consumes, differently."""

    def __init__(self, same: int, total: int, size: int = DATASET_SIZE) -> None:
        self.same, self.total, self.size = same, total, size

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator[List[int]]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        for i in range(self.total):
            yield [(i + (rank if i >= self.same else 0)) % self.size]


def labels_for(size: int = DATASET_SIZE, classes: int = 6) -> List[int]:
    return [i % classes for i in range(size)]


def loaders_by_kind(seed: Optional[int] = 0) -> Dict[str, DataLoader]:
    """One training loader per kind of sampler Lightning mishandles; each yields 6 batches in one process."""
    data = IndexDataset()
    return {
        "pk": DataLoader(data, batch_sampler=PKBatches(labels_for(), p=2, k=4, seed=seed)),
        "buckets": DataLoader(data, batch_sampler=LengthBuckets([(i * 5) % 13 for i in range(DATASET_SIZE)], 8)),
        "ignores_sampler": DataLoader(data, batch_sampler=ReversedBlocks(SequentialSampler(data), 8, False)),
        "index_sampler": DataLoader(data, batch_size=8, sampler=EveryThirdFirst(DATASET_SIZE)),
    }


def weights(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """A copy of ``module``'s state dict, to return from a call on ranks (see ``call_on_ranks``)."""
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


class BackboneAndHead(pl.LightningModule):
    """A backbone (8 -> 16 -> 4) and a head (4 -> 1), seeded alike in every process, trained on MSE: the model of
    the fine-tuning tests, which freeze and unfreeze its parts."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.head = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.backbone(x)), y)


class Recorder(pl.LightningModule):
    """Records, per rank, the dataset indices of every batch of every loader (``seen``) and facts about the run
    (``facts``), and writes them into ``out_dir`` on teardown (a run on ranks started for many runs returns
    :func:`records` instead: no ``out_dir``)."""

    def __init__(self, out_dir: Optional[str] = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 2)
        self.out_dir = out_dir
        self.seen: Dict[str, List[Any]] = {}
        self.facts: Dict[str, Any] = {}

    def _record(self, stage: str, batch: Any) -> torch.Tensor:
        batches = batch if isinstance(batch, dict) else {"only": batch}
        loss = torch.zeros(())
        for name, value in batches.items():
            if value is None:  # a loader that ran out, in CombinedLoader's "max_size" mode
                self.seen.setdefault(f"{stage}/{name}", []).append([self.current_epoch, None])
                continue
            x, indices = value
            self.seen.setdefault(f"{stage}/{name}", []).append([self.current_epoch, indices.tolist()])
            loss = loss + self.layer(x).pow(2).mean()
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._record("train", batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._record("val", batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._record("test", batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def teardown(self, stage: str) -> None:
        self.facts["backend"] = dist.get_backend() if dist.is_initialized() else None
        self.facts["allreduce_rounds"] = ALLREDUCE_ROUNDS[0]
        self.facts.update(getattr(self.trainer.strategy, "recorded", {}))
        if stage == "fit":
            loaders = self.trainer.train_dataloader
            loaders = loaders if isinstance(loaders, dict) else {"only": loaders}
            self.facts["epochs_set"] = {
                name: getattr(
                    getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None), "epochs_set", None
                )
                for name, loader in loaders.items()
            }
        if self.out_dir is None:
            return
        path = Path(self.out_dir) / f"rank{self.global_rank}.json"
        previous = json.loads(path.read_text()) if path.exists() else {"seen": {}, "facts": {}}
        previous["seen"].update(self.seen)
        previous["facts"].update(self.facts)
        path.write_text(json.dumps(previous))


# Gradient all-reduce rounds seen by `counting_allreduce` in this process (one bucket per round: tiny models).
ALLREDUCE_ROUNDS = [0]


def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]
    """A DDP comm hook that counts gradient all-reduce rounds and then all-reduces as DDP would.

    Unannotated on purpose: DDP compares annotations with real classes, and this module's are strings.
    """
    ALLREDUCE_ROUNDS[0] += 1
    return default_hooks.allreduce_hook(state, bucket)


class CountingDDP(CustomDDP):
    """A subclass overriding configure_ddp, as a user would: it registers the counting comm hook itself."""

    def configure_ddp(self, model: torch.nn.Module, device_ids: Optional[List[int]]) -> torch.nn.Module:
        wrapped = super().configure_ddp(model, device_ids)
        wrapped.register_comm_hook(None, counting_allreduce)  # type: ignore[operator]
        self.recorded = {"configure_ddp_override_used": True}
        return wrapped


def records(model: Recorder) -> Dict[str, Any]:
    """What ``model`` would write on teardown, as :func:`read_ranks` reads it back (JSON's types)."""
    return json.loads(json.dumps({"seen": model.seen, "facts": model.facts}))


def records_and_error(model: Recorder, run: Callable[[], Any]) -> Dict[str, Any]:
    """``run()`` on this rank; what ``model`` recorded meanwhile (see :func:`records`), and under ``"error"`` the
    traceback of what ``run`` raised (None if nothing): for runs that must fail before they train."""
    try:
        run()
    except Exception:
        return {**records(model), "error": traceback.format_exc()}
    return {**records(model), "error": None}


def assert_raised(result: Dict[str, Any], pattern: str) -> str:
    """The error of a :func:`records_and_error` result, which must match the regular expression ``pattern`` (as
    ``Outcome.raised`` checks a call's)."""
    from distributed_helpers import Outcome  # not at the top: the scripts' ranks import this module, and pytest with it

    Outcome(error=result["error"]).raised(pattern)
    return result["error"]


def read_ranks(out_dir: str, world_size: int) -> List[Dict[str, Any]]:
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world_size)]


def trainer_kwargs(**overrides: Any) -> Dict[str, Any]:
    """A small, quiet CPU Trainer configuration."""
    kwargs: Dict[str, Any] = dict(
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    kwargs.update(overrides)
    return kwargs


class ConstantLossOnRankOne(pl.LightningModule):
    """Fits a line; rank 1 returns ``torch.zeros((), requires_grad=True)`` at batch ``at_batch`` of every epoch (a
    batch with nothing to learn from, as metric-learning code writes it), a loss that reaches no parameter."""

    def __init__(self, at_batch: int = 1) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.at_batch = at_batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and batch_idx == self.at_batch:
            return torch.zeros((), requires_grad=True)
        x, y = batch
        return (self.net(x) - y).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def line_loader(size: int = 8, batch_size: int = 2) -> DataLoader:
    """Points of y = 2x + 1, in batches of ``batch_size``."""
    x = torch.linspace(-1, 1, size).unsqueeze(1)
    return DataLoader(TensorDataset(x, 2 * x + 1), batch_size=batch_size)
