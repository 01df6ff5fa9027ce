"""Register this package's strategy names with Lightning's ``StrategyRegistry``.

Lightning 2.x does not discover third-party strategies, so ``import lightning_ddp_ext`` calls
:func:`register`; calling it again changes nothing. The sharded names are registered whether or not
fairscale (the ``sharded`` extra) is installed, and fairscale is not imported here: without it, selecting
them (``Trainer(strategy="ddp_custom_sampler_sharded")``) constructs ``CustomDDPSharded``, whose ImportError
says what to install, instead of Lightning's "invalid strategy name".
"""
from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddp_ext.sharded import CustomDDPSharded
from lightning_ddp_ext.strategy import CustomDDP

__all__ = ["register"]


def register() -> list[str]:
    """Register every strategy name of this package and return those names."""
    strategies = [CustomDDP, CustomDDPSharded]
    for strategy in strategies:
        strategy.register_strategies(StrategyRegistry)
    return [name for strategy in strategies for name, _ in strategy.registry_entries]
