"""Fit with strategy="ddp_custom_sampler" (the popen launcher re-runs this file for rank 1).

Usage: python popen_fit.py OUT_DIR
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `scenarios`

import lightning.pytorch as pl  # noqa: E402
from scenarios import IndexDataset, PKBatches, Recorder, labels_for, trainer_kwargs  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_ddp_ext  # noqa: E402,F401  (registers "ddp_custom_sampler")

if __name__ == "__main__":
    loader = DataLoader(IndexDataset(), batch_sampler=PKBatches(labels_for(), p=2, k=4, seed=1))
    trainer = pl.Trainer(strategy="ddp_custom_sampler", **trainer_kwargs(max_epochs=1))
    trainer.fit(Recorder(sys.argv[1]), loader)
