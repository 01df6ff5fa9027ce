"""Two fits on one Trainer with ``static_graph=True`` and manual optimization, under the popen launcher (the
ranks live on between fits, so the strategy's state does too). Each rank records its weights after every step.

Usage: python static_graph_refit.py OUT_DIR
"""
import json
import sys
from pathlib import Path
from typing import Any, List

sys.path.insert(0, str(Path(__file__).resolve().parent))  # reliability_common, and tests/ through it

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from reliability_common import strategy  # noqa: E402
from scenarios import IndexDataset, trainer_kwargs  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


class ManualSteps(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(1, 1)
        self.automatic_optimization = False
        self.weights: List[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, index = batch
        self.manual_backward((self.layer(x).squeeze(1) - index.float()).pow(2).mean())
        optimizer.step()  # type: ignore[union-attr]
        optimizer.zero_grad()  # type: ignore[union-attr]
        self.weights.append(self.layer.weight.detach().flatten().tolist())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    model, loader = ManualSteps(), DataLoader(IndexDataset(8), batch_size=2)
    trainer = pl.Trainer(strategy=strategy(static_graph=True), **trainer_kwargs(max_epochs=1))
    trainer.fit(model, loader)
    trainer.fit_loop.max_epochs = 2  # the second fit goes on for one more epoch, with a new wrapper
    trainer.fit(model, loader)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(model.weights))
