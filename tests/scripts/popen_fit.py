"""Fit with strategy="ddp_custom_sampler" (the popen launcher re-runs this file for rank 1).

Usage: python popen_fit.py OUT_DIR [lr_find]

With ``lr_find``: the loader has two workers, and ``Tuner.lr_find`` runs on it first for more steps than an
epoch holds (its loop moves the user's sampler on to epoch 1) in the same two processes; the fit then trains
two epochs, which must be the sampler's epochs 0 and 1.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `scenarios`

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.tuner import Tuner  # noqa: E402
from scenarios import IndexDataset, PKBatches, Recorder, labels_for, trainer_kwargs  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_ddp_ext  # noqa: E402,F401  (registers "ddp_custom_sampler")

if __name__ == "__main__":
    tune = sys.argv[2:] == ["lr_find"]
    sampler = PKBatches(labels_for(), p=2, k=4, seed=1)  # 6 batches: 3 per rank
    loader = DataLoader(IndexDataset(), batch_sampler=sampler, num_workers=2 if tune else 0)
    trainer = pl.Trainer(strategy="ddp_custom_sampler", **trainer_kwargs(max_epochs=2 if tune else 1))
    model = Recorder(sys.argv[1])
    if tune:
        Tuner(trainer).lr_find(model, loader, num_training=5, early_stop_threshold=None, update_attr=False)
        model.seen = {}  # what the fit trains, only
    trainer.fit(model, loader)
