"""Write the small intersphinx inventories ``torch.inv`` and ``lightning.inv`` next to this file.

Why: the docs link to torch and Lightning through intersphinx, whose inventories live on the web. Builds
here (and in CI) run offline with warnings as errors, and an unreachable inventory is a warning. So
``conf.py`` reads these local files first and only reaches for the published ``objects.inv`` when asked to
(``LIGHTNING_DDP_EXT_DOCS_ONLINE=1``, see ``conf.py``).

The files are our own: a hand-kept list of the objects these docs mention, each with the page of the
published documentation that describes it. ``tests/test_docs.py`` checks that every name still exists in
the installed torch and Lightning and that the ``.inv`` files match what this script writes.

Run it after editing a table: ``python docs/_inventories/generate.py``.
"""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Dict, List, Tuple

HERE = Path(__file__).resolve().parent

TORCH_URL = "https://docs.pytorch.org/docs/stable/"
LIGHTNING_URL = "https://lightning.ai/docs/pytorch/stable/"

# (object name, role, page relative to the project URL). Unless the page names an anchor, the anchor is the
# object's name ("module-" and the name for modules), as Sphinx writes them.
Entry = Tuple[str, str, str]

DDP_PAGE = "generated/torch.nn.parallel.DistributedDataParallel.html"

TORCH: List[Entry] = [
    ("torch", "py:module", "torch.html"),
    ("torch.Tensor", "py:class", "tensors.html"),
    ("torch.device", "py:class", "tensor_attributes.html"),
    ("torch.dtype", "py:class", "tensor_attributes.html"),
    ("torch.Generator", "py:class", "generated/torch.Generator.html"),
    ("torch.nn.Module", "py:class", "generated/torch.nn.Module.html"),
    ("torch.nn.modules.module.Module", "py:class", "generated/torch.nn.Module.html#torch.nn.Module"),
    ("torch.nn.SyncBatchNorm", "py:class", "generated/torch.nn.SyncBatchNorm.html"),
    ("torch.nn.parallel.DistributedDataParallel", "py:class", DDP_PAGE),
    ("torch.nn.parallel.DistributedDataParallel.no_sync", "py:method", DDP_PAGE),
    ("torch.nn.parallel.DistributedDataParallel.register_comm_hook", "py:method", DDP_PAGE),
    ("torch.optim.Optimizer", "py:class", "optim.html"),
    ("torch.optim.optimizer.Optimizer", "py:class", "optim.html#torch.optim.Optimizer"),
    ("torch.utils.data.Dataset", "py:class", "data.html"),
    ("torch.utils.data.IterableDataset", "py:class", "data.html"),
    ("torch.utils.data.DataLoader", "py:class", "data.html"),
    ("torch.utils.data.dataloader.DataLoader", "py:class", "data.html#torch.utils.data.DataLoader"),
    ("torch.utils.data.Sampler", "py:class", "data.html"),
    ("torch.utils.data.BatchSampler", "py:class", "data.html"),
    ("torch.utils.data.RandomSampler", "py:class", "data.html"),
    ("torch.utils.data.SequentialSampler", "py:class", "data.html"),
    ("torch.utils.data.WeightedRandomSampler", "py:class", "data.html"),
    ("torch.utils.data.distributed.DistributedSampler", "py:class", "data.html"),
    ("torch.utils.data.get_worker_info", "py:function", "data.html"),
    ("torch.distributed", "py:module", "distributed.html"),
    ("torch.distributed.init_process_group", "py:function", "distributed.html"),
    ("torch.distributed.is_initialized", "py:function", "distributed.html"),
    ("torch.distributed.get_rank", "py:function", "distributed.html"),
    ("torch.distributed.get_world_size", "py:function", "distributed.html"),
    ("torch.distributed.all_gather", "py:function", "distributed.html"),
    ("torch.distributed.all_gather_object", "py:function", "distributed.html"),
    ("torch.distributed.all_reduce", "py:function", "distributed.html"),
    ("torch.distributed.barrier", "py:function", "distributed.html"),
    ("torch.distributed.optim.ZeroRedundancyOptimizer", "py:class", "distributed.optim.html"),
    ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook", "py:function", "ddp_comm_hooks.html"),
    ("torch.multiprocessing.spawn", "py:function", "multiprocessing.html"),
]


def lightning_api(documented: str, page: str = "") -> str:
    """Lightning documents a class on ``api/<full name>.html`` and its members on the same page, each anchored
    by the full name it is documented under."""
    return f"api/{page or documented}.html#{documented}"


TRAINER = "lightning.pytorch.trainer.trainer.Trainer"
MODULE = "lightning.pytorch.core.LightningModule"
DDP = "lightning.pytorch.strategies.DDPStrategy"
CHECKPOINT = "lightning.pytorch.callbacks.ModelCheckpoint"
ENVIRONMENTS = "lightning.pytorch.plugins.environments"

# Names under the defining module (what autodoc writes for annotations) and short aliases point at the page
# and anchor under which Lightning documents the object.
LIGHTNING: List[Entry] = [
    ("lightning.pytorch.Trainer", "py:class", lightning_api(TRAINER)),
    (TRAINER, "py:class", lightning_api(TRAINER)),
    ("lightning.pytorch.LightningModule", "py:class", lightning_api(MODULE)),
    (MODULE, "py:class", lightning_api(MODULE)),
    ("lightning.pytorch.core.module.LightningModule", "py:class", lightning_api(MODULE)),
    ("lightning.pytorch.strategies.Strategy", "py:class", lightning_api("lightning.pytorch.strategies.Strategy")),
    (DDP, "py:class", lightning_api(DDP)),
    ("lightning.pytorch.strategies.ddp.DDPStrategy", "py:class", lightning_api(DDP)),
    *[
        (f"{DDP}.{method}", "py:method", lightning_api(f"{DDP}.{method}", DDP))
        for method in ("configure_ddp", "block_backward_sync", "setup", "setup_distributed", "process_dataloader")
    ],
    (CHECKPOINT, "py:class", lightning_api(CHECKPOINT)),
    *[
        (f"{ENVIRONMENTS}.{name}", "py:class", lightning_api(f"{ENVIRONMENTS}.{name}"))
        for name in ("SLURMEnvironment", "TorchElasticEnvironment", "LightningEnvironment")
    ],
]

PROJECTS: Dict[str, Tuple[str, str, List[Entry]]] = {
    "torch.inv": ("PyTorch", "2.13", TORCH),
    "lightning.inv": ("Lightning", "2.6", LIGHTNING),
}


def inventory_bytes(project: str, version: str, entries: List[Entry]) -> bytes:
    """The bytes of a Sphinx version-2 inventory listing ``entries``."""
    header = (
        "# Sphinx inventory version 2\n"
        f"# Project: {project}\n"
        f"# Version: {version}\n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    lines = []
    for name, role, page in sorted(entries):
        if "#" in page:
            uri = page
        elif role == "py:module":
            uri = f"{page}#module-$"
        else:
            uri = f"{page}#$"
        lines.append(f"{name} {role} 1 {uri} -\n")
    return header.encode() + zlib.compress("".join(lines).encode(), 9)


def main() -> None:
    for filename, (project, version, entries) in PROJECTS.items():
        (HERE / filename).write_bytes(inventory_bytes(project, version, entries))
        print(f"wrote {HERE / filename} ({len(entries)} objects)")


if __name__ == "__main__":
    main()
