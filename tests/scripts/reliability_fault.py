"""Fit with the popen launcher ("ddp_custom_sampler") while one rank fails: it raises or SIGKILLs itself.

Usage: python reliability_fault.py OUT_DIR {raise,sigkill,hang} FAULT_RANK FAULT_STEP

The launcher re-runs this file for rank 1. Each rank that sees an exception writes ``rank<R>.error`` with
its traceback to OUT_DIR before re-raising, so a test can tell how a surviving rank ended.
"""
import sys

import lightning.pytorch as pl
from reliability_common import FaultyRecorder, pk_loader, run_guarded, strategy, trainer_kwargs

if __name__ == "__main__":
    out_dir, fault, fault_rank, fault_step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    trainer = pl.Trainer(strategy=strategy("popen"), **trainer_kwargs(max_epochs=3))
    model = FaultyRecorder(out_dir, fault=fault, fault_rank=fault_rank, fault_step=fault_step)
    run_guarded(out_dir, lambda: trainer.global_rank, lambda: trainer.fit(model, pk_loader(size=96)))
