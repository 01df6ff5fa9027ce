"""Register this package's strategy names with Lightning's ``StrategyRegistry``.

Lightning 2.x does not discover third-party strategies, so ``import lightning_ddp_ext`` calls
:func:`register`; calling it again changes nothing. The sharded names are registered only where fairscale
is installed (the ``sharded`` extra); fairscale itself is not imported here.
"""
from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddp_ext.sharded import CustomDDPSharded, fairscale_available
from lightning_ddp_ext.strategy import CustomDDP

__all__ = ["register"]


def register() -> list[str]:
    """Register every strategy name of this package and return those names."""
    strategies = [CustomDDP, CustomDDPSharded] if fairscale_available() else [CustomDDP]
    for strategy in strategies:
        strategy.register_strategies(StrategyRegistry)
    return [name for strategy in strategies for name, _ in strategy.registry_entries]
