"""Run one function on N freshly spawned ranks joined by a process group, with a hard deadline.

Benchmarks and distributed tests use this to stand up a small world without the worker pool. Ranks meet
through a FileStore in a temporary folder, so nothing listens on a network port; a rank that raises, or a
world that misses its deadline, kills every rank and raises in the caller, so no rank is left hanging.
"""

from __future__ import annotations

import datetime
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class DeadlineExceeded(TimeoutError):
    """The spawned world did not finish in time; its ranks were killed."""


def rank_device(rank: int, device: str) -> torch.device:
    """A rank's device: ``"cuda"`` gives each rank its own GPU, a numbered one (``"cuda:0"``) puts every rank on
    that GPU, anything else is the CPU."""
    if device == "cuda":
        return torch.device("cuda", rank)
    return torch.device(device) if device.startswith("cuda:") else torch.device("cpu")


def _rank_entry(rank: int, world: int, store_path: str, fn: Callable, args: tuple, device: str,
                pg_timeout_s: float, threads: int, backend: str | None) -> None:
    torch.set_num_threads(threads)
    local = rank_device(rank, device)
    if local.type == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group(
        backend or ("nccl" if local.type == "cuda" else "gloo"),
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(
    fn: Callable[..., Any],
    world: int,
    *,
    args: tuple = (),
    device: str = "cpu",
    deadline_s: float = 300.0,
    pg_timeout_s: float = 60.0,
    threads: int = 1,
    backend: str | None = None,
) -> None:
    """Call `fn(rank, world, *args)` on `world` spawned ranks (module-level `fn`, picklable `args`), on the
    devices ``rank_device`` gives, joined by ``backend`` (default: NCCL on CUDA, gloo on the CPU).

    Results travel however `fn` chooses (typically files in a folder passed in `args`)."""
    with tempfile.TemporaryDirectory() as folder:
        store_path = str(Path(folder) / "store")
        context = mp.start_processes(
            _rank_entry, args=(world, store_path, fn, args, device, pg_timeout_s, threads, backend),
            nprocs=world, join=False, start_method="spawn",
        )
        deadline = time.monotonic() + deadline_s
        try:
            while not context.join(timeout=max(min(deadline - time.monotonic(), 2.0), 0.1)):
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded(f"{world} ranks running {fn.__name__} missed their {deadline_s:.0f} s deadline")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()


def slowest_rank_median_s(fn: Callable[[], Any], device: torch.device, repeats: int, warmups: int = 1) -> float:
    """Median over `repeats` calls of the slowest rank's wall time, in seconds (every rank must call this)."""
    for _ in range(warmups):
        fn()
    return statistics.median(slowest_rank_seconds(fn, device) for _ in range(repeats))


def slowest_rank_seconds(fn: Callable[[], Any], device: torch.device) -> float:
    """One call of `fn` on every rank, started together: the slowest rank's wall time in seconds (every rank
    must call this)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()
