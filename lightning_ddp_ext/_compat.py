"""Every use of Lightning's private API, in one place.

Checked against lightning 2.2.0 to 2.6.6 (``LIGHTNING_CHECKED``); ``tests/test_compat.py`` fails loudly when
an installed Lightning no longer has what these functions rely on. Nothing else in the package touches an
underscored Lightning name.
"""
from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

LIGHTNING_CHECKED = (">=2.2.0", "<=2.6.6")
_USER_FLAG = "_lightning_ddp_ext_user_flag"  # where the user's use_distributed_sampler is kept


def take_over_sampler_replacement(trainer: "pl.Trainer", take_over: bool = True) -> bool:
    """Stop (or, with ``take_over=False``, restore) Lightning's own sampler replacement.

    Returns whether the user allowed sampler replacement at all (the Trainer's ``use_distributed_sampler``).
    Lightning replaces samplers in ``_DataConnector._prepare_dataloader``, which runs *before*
    ``Strategy.process_dataloader`` and there either raises for custom batch samplers or re-instantiates
    them. Its only switch is the accelerator connector's ``use_distributed_sampler`` flag (the Trainer
    argument), read at every dataloader set-up, which follows ``Strategy.setup`` in every trainer entry
    point. The user's original value is kept on the connector.
    """
    connector = trainer._accelerator_connector
    if not hasattr(connector, _USER_FLAG):
        setattr(connector, _USER_FLAG, bool(connector.use_distributed_sampler))
    user_flag = bool(getattr(connector, _USER_FLAG))
    connector.use_distributed_sampler = user_flag and not take_over
    return user_flag


@contextmanager
def configure_ddp_called_without_arguments(strategy: "DDPStrategy", adapter: Callable[[], None]) -> Iterator[None]:
    """Route ``DDPStrategy.setup``'s argument-less ``self.configure_ddp()`` call to ``adapter``.

    Our ``configure_ddp(model, device_ids)`` has the DDPPlugin signature, so Lightning's call would fail.
    An instance attribute shadows the method for the duration of ``setup`` only, which keeps the rest of
    Lightning's ``setup`` (SyncBatchNorm, precision, optimizers, model averaging) as it is.
    """
    strategy.__dict__["configure_ddp"] = adapter
    try:
        yield
    finally:
        strategy.__dict__.pop("configure_ddp", None)


def ddp_kwargs(strategy: "DDPStrategy") -> Dict[str, Any]:
    """The keyword arguments a DDPStrategy forwards to its model wrapper."""
    return strategy._ddp_kwargs


def process_group_timeout(strategy: "DDPStrategy") -> Optional[timedelta]:
    return strategy._timeout


def requested_process_group_backend(strategy: "DDPStrategy") -> Optional[str]:
    return strategy._process_group_backend


def set_process_group_backend(strategy: "DDPStrategy", backend: str) -> None:
    """Record the backend where ``DDPStrategy.process_group_backend`` reads it."""
    strategy._process_group_backend = backend


def comm_hook_arguments(strategy: "DDPStrategy") -> tuple[Optional[object], Optional[Callable], Optional[Callable]]:
    """``(ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper)`` as given to the constructor."""
    return strategy._ddp_comm_state, strategy._ddp_comm_hook, strategy._ddp_comm_wrapper



def inside_loop_steps(trainer: "pl.Trainer") -> bool:
    """Whether the running loop is between its first step and its epoch end (Lightning's own `on_step` test).

    The logger connector's ``_first_loop_iter`` is a bool from a loop's first batch until the epoch end is
    reached, and None before and after.
    """
    return trainer._logger_connector._first_loop_iter is not None
