"""Time gathering one large float32 tensor per rank three ways, on real gloo processes.

Why: ``lightning_ddp_ext.sync.sync_dicts`` sends tensors as tensors (a padded ``all_gather`` of raw bytes,
on Gloo cut into chunks of 8 MiB that are in flight together) instead of pickling them. This script checks
that this is worth it, against ``all_gather_object`` and against pickling into a byte tensor by hand, each
producing the same concatenated tensor on every rank.

    python benchmarks/gather.py --rows 100000 --dim 128 --repeats 5 [--plot gather.png] [--check]

Target: our path is at least 3x faster (median) than both pickling paths. A fourth row is one plain
``all_gather`` call of the same bytes into one buffer (no metadata, no checks, equal shapes only): what the
pickling paths pay for the transfer alone. Our path is faster than it, because Gloo overlaps the chunks'
copies and socket I/O on its worker threads.
"""
from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_ddp_ext import _exit
from lightning_ddp_ext.sync import sync_dicts

TARGET_SPEEDUP = 3.0
OURS = "sync_dicts (tensor path)"
ONE_CALL = "one all_gather call"
METHODS = [OURS, "all_gather_object", "manual pickle + byte tensor", ONE_CALL]
RIVALS = METHODS[1:3]


def gather_ours(tensor: torch.Tensor) -> torch.Tensor:
    return sync_dicts({"emb": tensor})["emb"]


def gather_object(tensor: torch.Tensor) -> torch.Tensor:
    parts: List[torch.Tensor] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(parts, tensor)
    return torch.cat(parts)


def gather_manual_pickle(tensor: torch.Tensor) -> torch.Tensor:
    payload = pickle.dumps(tensor, protocol=pickle.HIGHEST_PROTOCOL)
    with warnings.catch_warnings():  # the buffer is read-only; it is only read
        warnings.simplefilter("ignore", UserWarning)
        data = torch.frombuffer(payload, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    width = int(max(sizes))
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    received = [torch.empty(width, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(received, padded)
    return torch.cat([pickle.loads(memoryview(r[: int(s)].numpy())) for r, s in zip(received, sizes)])


def gather_bare(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes in one ``all_gather`` into views of one buffer; assumes every rank's shape is the same."""
    world = dist.get_world_size()
    flat = torch.empty((world * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
    dist.all_gather(list(flat.chunk(world)), tensor)
    return flat


GATHERS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    OURS: gather_ours,
    "all_gather_object": gather_object,
    "manual pickle + byte tensor": gather_manual_pickle,
    ONE_CALL: gather_bare,
}


def worker(rank: int, world_size: int, workdir: str, rows: int, dim: int, repeats: int) -> None:
    """Time every method ``repeats`` times, interleaved; rank 0 writes each repeat's slowest-rank time."""
    try:
        torch.set_num_threads(1)  # one process per core; keeps the methods from fighting over threads
        dist.init_process_group(
            "gloo",
            init_method=f"file://{workdir}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=300),
        )
        tensor = torch.randn(rows, dim, generator=torch.Generator().manual_seed(rank))
        expected = gather_ours(tensor)  # also the warm-up of our path
        for name in METHODS[1:]:  # warm-up, and proof that every method gathers the same thing
            if not torch.equal(GATHERS[name](tensor), expected):
                raise AssertionError(f"{name} gathered something else than {OURS}")
        del expected
        times: Dict[str, List[float]] = {name: [] for name in METHODS}
        for _ in range(repeats):
            for name in METHODS:
                dist.barrier()
                start = time.perf_counter()
                GATHERS[name](tensor)
                times[name].append(time.perf_counter() - start)
        everyone: List[Dict[str, List[float]]] = [None] * world_size  # type: ignore[list-item]
        dist.all_gather_object(everyone, times)
        if rank == 0:
            slowest = {name: [max(t[name][i] for t in everyone) for i in range(repeats)] for name in METHODS}
            (Path(workdir) / "times.json").write_text(json.dumps(slowest))
    except BaseException:
        (Path(workdir) / f"error_{rank}.txt").write_text(traceback.format_exc())
        raise SystemExit(1)
    finally:
        # The package's exit clean-up: on torch < 2.8 it lets Gloo's worker threads finish before the group's
        # destructor takes the GIL, which could otherwise hang this rank right after its last collective.
        _exit.destroy_process_group()


def run(rows: int, dim: int, repeats: int, world_size: int, timeout: float) -> Dict[str, List[float]]:
    """Spawn the workers, wait at most ``timeout`` seconds, and kill whatever is left."""
    with tempfile.TemporaryDirectory() as workdir:
        context = mp.start_processes(
            worker, args=(world_size, workdir, rows, dim, repeats), nprocs=world_size, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    if context.join(timeout=0.5):
                        break
                except mp.ProcessExitedException:
                    break
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(5)
        errors = sorted(Path(workdir).glob("error_*.txt"))
        if errors:
            raise RuntimeError("benchmark worker failed:\n" + "\n".join(p.read_text() for p in errors))
        result = Path(workdir) / "times.json"
        if not result.exists():
            raise RuntimeError(f"benchmark did not finish within {timeout:.0f}s")
        return json.loads(result.read_text())


def report(times: Dict[str, List[float]], rows: int, dim: int, world_size: int) -> bool:
    """Print the table and the verdict; True if the target is met."""
    medians = {name: statistics.median(t) for name, t in times.items()}
    mib = rows * dim * 4 / 2**20
    print(f"gathering a {rows}x{dim} float32 tensor ({mib:.1f} MiB) from each of {world_size} gloo ranks, "
          f"{len(times[OURS])} repeats (slowest rank per repeat)")
    print(f"{'method':<30} {'median s':>10} {'min s':>10} {'x ours':>8}")
    for name in METHODS:
        print(f"{name:<30} {medians[name]:>10.4f} {min(times[name]):>10.4f} {medians[name] / medians[OURS]:>8.2f}")
    slowest_rival = min(medians[name] / medians[OURS] for name in RIVALS)
    passed = slowest_rival >= TARGET_SPEEDUP
    print(f"target: our path >= {TARGET_SPEEDUP:.0f}x faster than the pickling paths; "
          f"got {slowest_rival:.2f}x -> {'PASS' if passed else 'FAIL'}")
    print(f"our path takes {medians[OURS] / medians[ONE_CALL]:.2f}x the time of one all_gather call of the same bytes")
    return passed


def plot(times: Dict[str, List[float]], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install 'lightning_ddp_ext[bench]'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    medians = [statistics.median(times[name]) for name in METHODS]
    figure, axes = plt.subplots(figsize=(7, 4))
    labels = [name.replace(" (", "\n(").replace(" + ", "\n+ ") for name in METHODS]  # no overlapping labels
    axes.bar(labels, medians, color=["tab:green", "tab:gray", "tab:gray", "tab:blue"])
    axes.set_ylabel("median seconds (lower is better)")
    axes.set_title("Gathering one large tensor per rank")
    figure.tight_layout()
    figure.savefig(path)
    print(f"wrote {path}")


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="first dim of each rank's tensor")
    parser.add_argument("--dim", type=int, default=128, help="second dim of each rank's tensor")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per method (after one warm-up)")
    parser.add_argument("--world-size", type=int, default=2, help="number of gloo processes")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the workers are killed")
    parser.add_argument("--plot", metavar="PATH", help="also write a bar chart PNG (needs matplotlib)")
    parser.add_argument("--check", action="store_true", help="exit with status 1 if the target is missed")
    args = parser.parse_args(argv)

    times = run(args.rows, args.dim, args.repeats, args.world_size, args.timeout)
    passed = report(times, args.rows, args.dim, args.world_size)
    if args.plot:
        plot(times, args.plot)
    return 0 if passed or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
