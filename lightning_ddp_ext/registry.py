"""Register this package's strategy names with Lightning's ``StrategyRegistry``.

Lightning 2.x does not discover third-party strategies, so ``import lightning_ddp_ext`` calls
:func:`register`; calling it again changes nothing.
"""
from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddp_ext.strategy import CustomDDP

__all__ = ["register"]


def register() -> list[str]:
    """Register every strategy name of this package and return those names."""
    CustomDDP.register_strategies(StrategyRegistry)
    return [name for name, _ in CustomDDP.registry_entries]
