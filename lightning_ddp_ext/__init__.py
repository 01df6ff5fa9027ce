"""lightning_ddp_ext: DDP for PyTorch Lightning 2.x that keeps custom batch samplers whole.

``import lightning_ddp_ext`` registers the strategy names ("ddp_custom_sampler", ...) with Lightning. The
sampler layer (``samplers``, ``dataloader``, ``consistency``, ``sync``) imports no Lightning and works with
plain ``torch.distributed``; it stays importable where Lightning is not installed.
"""
from lightning_ddp_ext._version import __version__
from lightning_ddp_ext.dataloader import patch_dataloader_to_ddp
from lightning_ddp_ext.samplers import DistributedBatchSamplerWrapper, DistributedSamplerWrapper

__all__ = [
    "__version__",
    "CustomDDP",
    "CustomDDPSharded",
    "DistributedBatchSamplerWrapper",
    "DistributedSamplerWrapper",
    "patch_dataloader_to_ddp",
    "register",
]

try:
    from lightning_ddp_ext.strategy import CustomDDP
    from lightning_ddp_ext.sharded import CustomDDPSharded  # imports fairscale only when constructed
    from lightning_ddp_ext.registry import register
except ModuleNotFoundError as error:  # only a missing Lightning is tolerated, never a broken import of ours
    if error.name is None or error.name.split(".")[0] not in ("lightning", "lightning_utilities"):
        raise
    _LIGHTNING_IMPORT_ERROR: ModuleNotFoundError = error
    _NEEDS_LIGHTNING = ("CustomDDP", "CustomDDPSharded", "register")
    __all__ = [name for name in __all__ if name not in _NEEDS_LIGHTNING]  # so that `import *` works without it

    def __getattr__(name: str) -> object:
        if name in _NEEDS_LIGHTNING:
            raise ImportError(
                f"lightning_ddp_ext.{name} needs Lightning 2.x: pip install 'lightning>=2.2,!=2.5.0.*,<3'."
            ) from _LIGHTNING_IMPORT_ERROR
        raise AttributeError(f"module 'lightning_ddp_ext' has no attribute {name!r}")

else:
    register()
