"""Fail loudly when an installed Lightning no longer has the private API `_compat` relies on."""
from __future__ import annotations

import inspect
from datetime import timedelta

import lightning
import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.connectors.data_connector import _DataConnector
from packaging.version import Version
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lightning_ddp_ext import CustomDDP, _compat, patch_dataloader_to_ddp


def hook(state, bucket):  # type: ignore[no-untyped-def]
    raise AssertionError("never called")


def test_installed_lightning_is_in_the_checked_range() -> None:
    low, high = (Version(bound.lstrip("<>=")) for bound in _compat.LIGHTNING_CHECKED)
    assert low <= Version(lightning.__version__) <= high, (
        f"lightning {lightning.__version__} is outside the range _compat.py was checked on {_compat.LIGHTNING_CHECKED}:"
        " re-check every function there, then widen LIGHTNING_CHECKED and setup.cfg"
    )


def test_ddp_strategy_attributes() -> None:
    strategy = DDPStrategy(
        timeout=timedelta(seconds=12), process_group_backend="gloo", ddp_comm_hook=hook, static_graph=True
    )
    assert _compat.ddp_kwargs(strategy) == {"static_graph": True}
    assert _compat.process_group_timeout(strategy) == timedelta(seconds=12)
    assert _compat.requested_process_group_backend(strategy) == "gloo"
    assert _compat.comm_hook_arguments(strategy) == (None, hook, None)
    _compat.set_process_group_backend(strategy, "nccl")
    assert strategy.process_group_backend == "nccl"


def test_setup_calls_configure_ddp_without_arguments() -> None:
    assert "self.configure_ddp()" in inspect.getsource(DDPStrategy.setup)


def test_sampler_replacement_switch() -> None:
    assert "use_distributed_sampler" in inspect.getsource(_DataConnector._requires_distributed_sampler)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=CustomDDP(), logger=False)
    assert trainer._accelerator_connector.use_distributed_sampler is True
    assert _compat.take_over_sampler_replacement(trainer) is True
    assert trainer._accelerator_connector.use_distributed_sampler is False
    assert _compat.take_over_sampler_replacement(trainer) is True  # the user's value is remembered
    assert _compat.take_over_sampler_replacement(trainer, take_over=False) is True  # e.g. for predict
    assert trainer._accelerator_connector.use_distributed_sampler is True
    # where Lightning still shards (predict), it leaves a loader our wrapper deals as it leaves a DistributedSampler
    requires = trainer._data_connector._requires_distributed_sampler
    dealt = patch_dataloader_to_ddp(DataLoader(range(8), batch_size=2), 2, 0, even_shares=False)
    assert requires(DataLoader(range(8), batch_size=2)) and not requires(dealt)
    refused = pl.Trainer(
        accelerator="cpu", devices=2, strategy=CustomDDP(), use_distributed_sampler=False, logger=False
    )
    assert _compat.take_over_sampler_replacement(refused) is False


def test_static_graph_flush_flag() -> None:
    """Lightning 2.6.0 added the flag (#21251: the first static-graph iteration under manual optimization)."""
    strategy = DDPStrategy(static_graph=True)
    assert hasattr(strategy, "_pl_static_graph_delay_done") == (Version(lightning.__version__) >= Version("2.6.0"))
    if hasattr(strategy, "_pl_static_graph_delay_done"):
        assert "self._pl_static_graph_delay_done = True" in inspect.getsource(DDPStrategy.post_backward)
        strategy._pl_static_graph_delay_done = True
    _compat.restart_static_graph_delay(strategy)
    assert getattr(strategy, "_pl_static_graph_delay_done", False) is False


def test_comm_hook_states() -> None:
    """torch's DDP keeps (hook, state) pairs in ``_comm_hooks``; without them, the strategy's own state."""
    if Version(torch.__version__.split("+")[0]) >= Version("2.3"):  # 2.1 and 2.2 keep no such list (checked)
        assert "self._comm_hooks.append((hook, state))" in inspect.getsource(DistributedDataParallel.register_comm_hook)
    state, other = object(), object()

    class Wrapper:
        _comm_hooks = [(hook, state), (hook, other)]

    strategy = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)
    assert _compat.comm_hook_states(Wrapper(), strategy) == [state, other]
    assert _compat.comm_hook_states(object(), strategy) == [state]
    assert _compat.comm_hook_states(object(), DDPStrategy()) == []


def test_loader_states_restored_by_the_fit_loop() -> None:
    """The fit loop keeps a checkpoint's loader states until it has set up the train loader, then loads them into
    the loaders that have ``state_dict`` and ``load_state_dict`` (and only those)."""
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from torch.utils.data import DataLoader

    setup = inspect.getsource(_FitLoop.setup_data)
    assert setup.index("_process_dataloader(") < setup.index("self._load_combined_loader_states()")
    assert "self._combined_loader_states_to_load = state_dict.get(" in inspect.getsource(_FitLoop.on_load_checkpoint)

    class Stateful(DataLoader):
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    assert "if not self.restarting or not self._combined_loader_states_to_load" in inspect.getsource(
        _FitLoop._load_combined_loader_states
    )
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    assert not _compat.restores_loader_position(trainer, Stateful(range(4)))  # nothing to load
    trainer.fit_loop._combined_loader_states_to_load = [{}]
    assert not _compat.restores_loader_position(trainer, Stateful(range(4)))  # not restarting: not loaded
    trainer.fit_loop._restarting = True  # as restoring a checkpoint written inside an epoch leaves it
    assert _compat.restores_loader_position(trainer, Stateful(range(4)))
    assert not _compat.restores_loader_position(trainer, DataLoader(range(4)))


def test_training_iterator_made_again_as_the_fit_loop_makes_it() -> None:
    """The checkpoint connector restores the loops just before it asks the strategy to load the optimizer states
    (where CustomDDP prepares a training loader set up before the checkpoint was loaded); the fit loop's set-up
    loads the loader states, then makes the iterator that a resumed fit's first epoch runs on, which the training
    epoch loop does not make again while it restarts."""
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    restore = inspect.getsource(_CheckpointConnector.restore_training_state)
    assert restore.index("self.restore_loops()") < restore.index("self.restore_optimizers_and_schedulers()")
    assert "strategy.load_optimizer_state_dict(" in inspect.getsource(_CheckpointConnector.restore_optimizers)
    setup = inspect.getsource(_FitLoop.setup_data)
    assert setup.index("self._load_combined_loader_states()") < setup.index("iter(self._data_fetcher)")
    assert "not self.restarting" in inspect.getsource(_TrainingEpochLoop.on_run_start)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    assert _compat.can_restart_training_iterator(trainer) is False  # not set up: there is no iterator to make again


def test_evaluation_loop_knows_its_combined_loader_and_progress() -> None:
    """`evaluated_batches` reads them for a CombinedLoader that steps its loaders together (mode "max_size")."""
    from lightning.pytorch.loops.evaluation_loop import _EvaluationLoop
    from lightning.pytorch.utilities import CombinedLoader

    init = inspect.getsource(_EvaluationLoop.__init__)
    assert "self._combined_loader" in init and "self.batch_progress = _BatchProgress()" in init
    assert CombinedLoader([[0]], mode="max_size")._mode == "max_size"


def test_multiprocessing_launcher_hooks() -> None:
    """`_compat._Launcher` records a rank's error around `_wrapping_function(process_idx, ...)` (whose trainer and
    call arguments it reads for forkserver ranks) and names the process that failed first from `self.procs`,
    which `launch` sets."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    parameters = list(inspect.signature(_MultiProcessingLauncher._wrapping_function).parameters)
    assert parameters[:6] == ["self", "process_idx", "trainer", "function", "args", "kwargs"]
    assert "self.procs = process_context.processes" in inspect.getsource(_MultiProcessingLauncher.launch)
    for start_method in ("spawn", "fork", "forkserver"):
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=CustomDDP(start_method=start_method), logger=False)
        assert type(trainer.strategy._launcher) is _compat._Launcher
