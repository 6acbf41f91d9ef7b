"""What the benchmarks share: option parsing, rank devices, spawning a world of ranks and collecting their
rows, and table formatting; runs in the CLI process and in the ranks it spawns."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable

import torch

from ..distributed.spawn import spawn_ranks

BENCH_DEADLINE_S = 1800.0  # a whole world of ranks; also the process-group timeout


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
