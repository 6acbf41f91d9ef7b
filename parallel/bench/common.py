"""What the benchmarks share: option parsing, rank devices, spawning a world of ranks and collecting their
rows, the interleaved timing harness, a progress line per measured run, a rank's peak host memory, and table
formatting; runs in the CLI process and in the ranks it spawns."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..distributed.spawn import spawn_ranks

BENCH_DEADLINE_S = 1800.0  # a whole world of ranks; also the process-group timeout
PROGRESS_ENV = "WANMESH_BENCH_PROGRESS"  # the benchmark's name while `wanmesh bench` shows progress (ranks inherit it)


def measured_runs(total: int) -> Callable[[str], None]:
    """A ``run(what)`` callback to call before each of a benchmark's ``total`` measured runs: a line on stderr
    (``cli/progress.Progress.runs``: n/total, time per run and left) when the command line set ``PROGRESS_ENV``
    (not ``--quiet``), in the CLI process or in rank 0 of a spawned world; nothing otherwise."""
    from ..cli.progress import Progress

    name = os.environ.get(PROGRESS_ENV)
    return Progress(quiet=not name or _rank() > 0).runs(f"bench {name}", total)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def int_list(text: str, flag: str) -> list[int]:
    """Comma-separated positive integers given to ``flag``."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, e.g. 1,2; got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} needs positive integers, e.g. 1,2; got {text!r}")
    return values


def rank_device(settings: dict, rank: int) -> torch.device:
    return torch.device("cuda", rank) if settings["device"] == "cuda" else torch.device("cpu")


def model_path(args, tiny_name: str = "model") -> str:
    """``--model``, or the tiny tree's file ``tiny_name`` (``files.TINY_FILES``; from ``--models`` or the cache)."""
    if args.model:
        return args.model
    from ..tiny.files import TINY_FILES, ensure_tiny_models, tiny_cache_dir

    return str(ensure_tiny_models(args.models or tiny_cache_dir()) / TINY_FILES[tiny_name])


def model_config(path: str, vace_module: str | None = None) -> dict:
    """A transformer's full config (defaults included), from shapes and metadata only: no tensor is read."""
    from ..weights.loaders import build_transformer, transformer_weight_source

    with contextlib.ExitStack() as stack:
        model_class, config, _ = transformer_weight_source(path, vace_module, stack)
        return dict(build_transformer(model_class, config).config)


def mib(value: int | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value / 2**20:.{digits}f}"


def run_world(rank_main: Callable, world: int, settings: dict, **spawn_options) -> list:
    """Spawn ``world`` ranks running ``rank_main(rank, world, settings, folder)``; each rank that writes
    ``folder/rank<N>.json`` contributes its JSON, in rank order."""
    with tempfile.TemporaryDirectory() as folder:
        spawn_ranks(rank_main, world, args=(settings, folder), device=settings["device"],
                    deadline_s=BENCH_DEADLINE_S, pg_timeout_s=BENCH_DEADLINE_S, **spawn_options)
        files = [Path(folder, f"rank{rank}.json") for rank in range(world)]
        return [json.loads(path.read_text()) for path in files if path.is_file()]


def write_rank_result(folder: str, rank: int, result) -> None:
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))


def cpu_seconds(pids: list[int]) -> float:
    """The CPU time (user and system, all threads) the ranks' processes used so far: the work done, which other
    load on the machine stretches far less than the wall time."""
    import psutil

    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def _anonymous_rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakAnonymousMemory:
    """Samples this process's anonymous resident memory (Linux) in a thread; file-backed pages of the
    memory-mapped checkpoint are page cache, not the rank's own memory, so they are left out."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.baseline = _anonymous_rss_bytes()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, _anonymous_rss_bytes())

    def __enter__(self) -> PeakAnonymousMemory:
        if self.baseline is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.baseline is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _anonymous_rss_bytes())

    @property
    def increase(self) -> int | None:
        return None if self.baseline is None else self.peak - self.baseline


@dataclass(frozen=True)
class Timing:
    median: float
    low: float
    high: float
    samples: tuple[float, ...] = ()  # every timed round, in order

    def as_list(self) -> list[float]:
        """[fastest, slowest] seconds: the spread the tables print beside the median."""
        return [self.low, self.high]

    @classmethod
    def of(cls, samples: list[float]) -> "Timing":
        """The median, fastest and slowest of timed rounds."""
        return cls(statistics.median(samples), min(samples), max(samples), tuple(samples))


def check_repeats(repeats: int) -> None:
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")


def wall_seconds(function: Callable[[], object], device: torch.device) -> float:
    """One call's wall time in this process, CUDA work included."""
    _sync(device)
    start = time.perf_counter()
    function()
    _sync(device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(functions: dict[str, Callable[[], object]], device: torch.device, repeats: int,
                     seconds: Callable[[Callable[[], object], torch.device], float] = wall_seconds) -> dict[str, Timing]:
    """Seconds per call of each function: one warm-up call each, then `repeats` rounds calling all in turn
    (interleaved, so drifting machine load hits every function alike), each call timed by `seconds` (in ranks:
    ``spawn.slowest_rank_seconds``); the median and the fastest and slowest round. Each call is announced
    (``measured_runs``)."""
    check_repeats(repeats)
    run = measured_runs(len(functions) * (repeats + 1))
    for name, function in functions.items():
        run(f"{name}, warm-up")
        function()
    samples: dict[str, list[float]] = {name: [] for name in functions}
    for round_index in range(repeats):
        for name, function in functions.items():
            run(f"{name}, round {round_index + 1}/{repeats}")
            samples[name].append(seconds(function, device))
    return {name: Timing.of(s) for name, s in samples.items()}
