"""Draw ``docs/_static/dealing.png``: how a batch sampler's sequence is dealt to 3 ranks.

The picture is computed, not drawn by hand: the ranks' rows come from ``DistributedBatchSamplerWrapper``
itself (7 batches, 3 ranks, ``pad=True``, and the same with ``shuffle=True, shuffle_window=1``). The rows are
also stored in the PNG's "Description" text chunk, so that ``--check`` (run by ``tests/test_docs.py``) can tell
when the picture no longer matches what the wrapper deals.

Run: ``python docs/_scripts/dealing_diagram.py [OUTPUT.png]``, or ``--check`` to compare the shipped picture with
what the wrapper deals now (needs matplotlib, as the ``bench`` extra installs).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import List, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

from lightning_ddp_ext.samplers import DistributedBatchSamplerWrapper  # noqa: E402

BATCHES = [[2 * b, 2 * b + 1] for b in range(7)]  # b0 .. b6, two indices each
WORLD = 3
COLOURS = plt.get_cmap("tab10").colors
OUT = Path(__file__).resolve().parents[1] / "_static" / "dealing.png"


def shares(**options: object) -> List[List[int]]:
    """For each rank, the positions (in BATCHES) of the batches it yields in epoch 0."""
    result = []
    for rank in range(WORLD):
        wrapper = DistributedBatchSamplerWrapper(BATCHES, num_replicas=WORLD, rank=rank, **options)
        wrapper.set_epoch(0)
        result.append([BATCHES.index(batch) for batch in wrapper])
    return result


def box(axes: plt.Axes, x: float, y: float, batch: int, padding: bool = False) -> None:
    axes.add_patch(
        FancyBboxPatch(
            (x + 0.06, y + 0.1), 0.88, 0.8, boxstyle="round,pad=0.02", linewidth=1.2,
            facecolor=COLOURS[batch % len(COLOURS)], alpha=0.35 if padding else 0.9,
            edgecolor="black", linestyle="--" if padding else "-",
        )
    )
    axes.text(x + 0.5, y + 0.5, f"b{batch}" + ("'" if padding else ""), ha="center", va="center", fontsize=11)


def padding_flags(rows: Sequence[Sequence[int]]) -> List[List[bool]]:
    """Whether each yielded batch is a padding repeat: within a round every position holds a different batch,
    so the position of batch k in round i is the one of 3i, 3i+1, 3i+2 that holds k; past 6 it is padding."""
    flags = []
    for row in rows:
        flags.append([
            next(p for p in range(WORLD * i, WORLD * i + WORLD) if p % len(BATCHES) == batch) >= len(BATCHES)
            for i, batch in enumerate(row)
        ])
    return flags


def panel(axes: plt.Axes, title: str, top_label: str, rows: Sequence[Sequence[int]]) -> None:
    """The sequence being dealt on top, then one row per rank: rank r takes column r of every round of 3."""
    rounds = len(rows[0])
    flags = padding_flags(rows)
    axes.set_xlim(-2.2, rounds * WORLD + 0.2)
    axes.set_ylim(-WORLD - 0.3, 1.9)
    axes.axis("off")
    axes.set_title(title, loc="left", fontsize=12)
    axes.text(-0.2, 1.5, top_label, ha="right", va="center", fontsize=10)
    for i in range(rounds):
        for rank in range(WORLD):
            column = WORLD * i + rank
            box(axes, column, 1.0, rows[rank][i], padding=flags[rank][i])
            box(axes, column, -rank - 1, rows[rank][i], padding=flags[rank][i])
    for rank in range(WORLD):
        axes.text(-0.2, -rank - 0.5, f"rank {rank}", ha="right", va="center", fontsize=10)


def dealt() -> dict:
    """What the picture shows: each rank's batches, without and with a shuffle in windows of one round."""
    return {"plain": shares(), "shuffled": shares(shuffle=True, shuffle_window=1, seed=0)}


def main(out: Path = OUT) -> None:
    rows = dealt()
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9.0, 6.4))
    panel(top, "shuffle=False: rank r yields positions r, r+3, r+6; b0', b1' repeat b0, b1 to fill the last round",
          "user's sequence", rows["plain"])
    panel(bottom, "shuffle=True, shuffle_window=1: every round of 3 is permuted (seed + epoch), then dealt",
          "permuted", rows["shuffled"])
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110, metadata={"Description": json.dumps(rows), "Software": None})
    print(f"wrote {out}")


def shown(path: Path = OUT) -> dict:
    """The rows stored in a picture this script drew."""
    from PIL import Image  # a dependency of matplotlib

    with Image.open(path) as image:
        return json.loads(image.text["Description"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", nargs="?", type=Path, default=OUT, help=f"the PNG to write (default {OUT})")
    parser.add_argument("--check", action="store_true", help="exit 1 if the PNG no longer shows what is dealt")
    options = parser.parse_args()
    if not options.check:
        main(options.output)
    elif shown(options.output) != dealt():
        raise SystemExit(f"{options.output} is stale: run python docs/_scripts/dealing_diagram.py")
    else:
        print(f"{options.output} shows what the wrapper deals")
