"""`wanmesh bench pool`: what a worker-pool round trip costs.

Two measurements on a live pool: the round-trip time of an empty request (no tensors, every rank
answers), and the throughput of moving an IMAGE-sized tensor (81 x 480 x 832 x 3 float32 by default) to
the workers and back (the ``echo`` diagnostic), against a plain in-process copy of the same tensor measured
in the same run, so the ratio says what the process boundary costs. A third measures how a streaming chunk
(``--chunk-frames`` frames of that size) reaches the driver: handed over in a shared-memory segment of its
own, as rank 0 sends it, against pickling it through a socket pair, interleaved; it reports how long the
sender is held (rank 0, and so every rank at its next collective) and how long until the receiver holds it.
A fourth (CPU pools) times pool starts until every rank answered a first request, with the workers forked from
the worker template against each worker importing its code in a fresh interpreter, interleaved after one
warm-up of each, and checks which parent each worker had.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import torch

from .. import protocol as P
from ..config import ParallelConfig
from ..driver.pool import WorkerPool
from ..driver.worker_template import TEMPLATE_ENV, shared_template_pid
from ..transport import new_segment_prefix, pack_handed_over, take_handed_over
from .common import measured_runs

IMAGE_SHAPE = (81, 480, 832, 3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, default=2, help="ranks in the pool (default 2)")
    parser.add_argument("--devices", default="auto", help="auto, cpu, cuda or a list such as cuda:0,cuda:1")
    parser.add_argument("--backend", choices=["local", "ray"], default="local")
    parser.add_argument("--frames", type=int, default=IMAGE_SHAPE[0])
    parser.add_argument("--height", type=int, default=IMAGE_SHAPE[1])
    parser.add_argument("--width", type=int, default=IMAGE_SHAPE[2])
    parser.add_argument("--repeats", type=int, default=5, help="timed transfers (after one warm-up)")
    parser.add_argument("--empty-repeats", type=int, default=50, help="timed empty requests")
    parser.add_argument("--chunk-frames", type=int, default=12, help="frames of one streaming chunk (3 latent frames)")
    parser.add_argument("--chunk-repeats", type=int, default=10, help="timed chunk hand-overs per transport")
    parser.add_argument("--start-repeats", type=int, default=3,
                        help="timed pool starts per way of starting (after one warm-up each; CPU pools; 0: none)")
    parser.add_argument("--json", type=Path, help="also write the results here")


def _timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()  # warm-up: starts lazy state and faults in the shared-memory arenas
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def measure(pool: WorkerPool, image: torch.Tensor, repeats: int, empty_repeats: int,
            run: Callable[[str], None] = lambda what: None) -> dict[str, float]:
    """Empty requests, then moving ``image`` to the workers and back against copying it; ``run`` announces each
    (``common.measured_runs``)."""
    run(f"{empty_repeats} empty requests")
    empty = _timed(lambda: pool.call(P.Diagnostic("echo")), empty_repeats)

    def round_trip() -> None:
        back = pool.call(P.Diagnostic("echo", tensors=[image])).tensors[0]
        if back.shape != image.shape:
            raise RuntimeError(f"echo returned shape {list(back.shape)} for {list(image.shape)}")

    run(f"{repeats} round trips and copies of {list(image.shape)}")
    moved = _timed(round_trip, repeats)
    copied = _timed(image.clone, repeats)
    nbytes = image.numel() * image.element_size()
    pool_s, copy_s = statistics.median(moved), statistics.median(copied)
    return {
        "empty_request_ms": statistics.median(empty) * 1e3,
        "empty_request_p90_ms": sorted(empty)[int(0.9 * (len(empty) - 1))] * 1e3,
        "tensor_mib": nbytes / 2**20,
        "pool_round_trip_s": pool_s,
        "pool_gib_per_s": 2 * nbytes / pool_s / 2**30,  # there and back
        "copy_s": copy_s,
        "copy_gib_per_s": nbytes / copy_s / 2**30,
        "ratio": pool_s / copy_s,
    }


def _through_pipe(sender: Connection, receiver: Connection, chunk: dict[str, Any]) -> tuple[float, float]:
    arrived = threading.Event()
    threading.Thread(target=lambda: (receiver.recv(), arrived.set()), daemon=True).start()
    start = time.perf_counter()
    sender.send({key: value.numpy() for key, value in chunk.items()})
    held = time.perf_counter() - start
    arrived.wait()
    return held, time.perf_counter() - start


def _through_shared_memory(prefix: str, index: int, chunk: dict[str, Any]) -> tuple[float, float]:
    start = time.perf_counter()
    packed = pack_handed_over(chunk, f"{prefix}_bench{index}")
    held = time.perf_counter() - start
    take_handed_over(packed)
    return held, time.perf_counter() - start


def measure_chunk_handover(frames: int, height: int, width: int, repeats: int) -> dict[str, float]:
    """Median and spread (min, max) in ms of both transports, run alternately after one warm-up each."""
    chunk = {"frames": torch.rand(frames, height, width, 3), "latents": torch.zeros(1, 16, (frames + 3) // 4,
                                                                                  height // 8, width // 8)}
    left, right = socket.socketpair()
    sender, receiver = Connection(left.detach()), Connection(right.detach())
    prefix = new_segment_prefix()
    samples: dict[str, list[tuple[float, float]]] = {"pipe": [], "shm": []}
    try:
        for index in range(repeats + 1):
            pipe, shm = _through_pipe(sender, receiver, chunk), _through_shared_memory(prefix, index, chunk)
            if index > 0:
                samples["pipe"].append(pipe)
                samples["shm"].append(shm)
    finally:
        sender.close()
        receiver.close()
    results = {"chunk_mib": sum(t.numel() * t.element_size() for t in chunk.values()) / 2**20}
    for name, pairs in samples.items():
        for column, label in ((0, "held"), (1, "received")):
            values = [pair[column] * 1e3 for pair in pairs]
            results[f"chunk_{name}_{label}_ms"] = statistics.median(values)
            results[f"chunk_{name}_{label}_spread_ms"] = (min(values), max(values))
    return results


def _start_once(config: ParallelConfig, template: bool) -> tuple[float, bool]:
    """Seconds from nothing to every rank having answered an empty request, and whether every worker was forked
    by the worker template (its parent)."""
    import psutil

    saved = os.environ.get(TEMPLATE_ENV)
    os.environ[TEMPLATE_ENV] = "1" if template else "0"
    try:
        start = time.perf_counter()
        with WorkerPool(config) as pool:
            pool.call(P.Diagnostic("echo"))
            elapsed = time.perf_counter() - start
            parents = {psutil.Process(pid).ppid() for pid in pool.pids()}
    finally:
        if saved is None:
            os.environ.pop(TEMPLATE_ENV, None)
        else:
            os.environ[TEMPLATE_ENV] = saved
    return elapsed, parents == {shared_template_pid()}


def measure_pool_starts(config: ParallelConfig, repeats: int) -> dict[str, Any]:
    """Median and spread (min, max) in seconds of both ways to start, alternated after one warm-up each (the
    template's warm-up pays its own imports), and whether each way's workers had the parent it should."""
    samples: dict[str, list[float]] = {"template": [], "fresh": []}
    forked = {"template": True, "fresh": False}
    for index in range(repeats + 1):
        for way in samples:
            seconds, by_template = _start_once(config, way == "template")
            forked[way] = (forked[way] and by_template) if way == "template" else (forked[way] or by_template)
            if index > 0:
                samples[way].append(seconds)
    results: dict[str, Any] = {"start_template_forked": forked["template"], "start_fresh_forked": forked["fresh"]}
    for way, values in samples.items():
        results[f"start_{way}_s"] = statistics.median(values)
        results[f"start_{way}_spread_s"] = (min(values), max(values))
    results["start_ratio"] = results["start_fresh_s"] / results["start_template_s"]
    return results


def _ms(r: dict[str, Any], key: str) -> str:
    low, high = r[f"{key}_spread_ms"]
    return f"{r[f'{key}_ms']:.1f} ms  ({low:.1f}..{high:.1f})"


def format_table(config: ParallelConfig, shape: tuple[int, ...], r: dict[str, float]) -> str:
    rows = [
        ("empty request round trip (median)", f"{r['empty_request_ms']:.2f} ms"),
        ("empty request round trip (p90)", f"{r['empty_request_p90_ms']:.2f} ms"),
        (f"IMAGE {'x'.join(map(str, shape))} float32", f"{r['tensor_mib']:.0f} MiB"),
        ("to the workers and back (median)", f"{r['pool_round_trip_s'] * 1e3:.1f} ms  ({r['pool_gib_per_s']:.2f} GiB/s)"),
        ("in-process copy (median)", f"{r['copy_s'] * 1e3:.1f} ms  ({r['copy_gib_per_s']:.2f} GiB/s)"),
        ("pool round trip / in-process copy", f"{r['ratio']:.2f}x"),
        (f"stream chunk {r['chunk_mib']:.0f} MiB: sender held, shared memory", _ms(r, "chunk_shm_held")),
        ("  sender held, pickled through a pipe", _ms(r, "chunk_pipe_held")),
        ("  until received, shared memory", _ms(r, "chunk_shm_received")),
        ("  until received, pickled through a pipe", _ms(r, "chunk_pipe_received")),
    ]
    if "start_ratio" in r:
        seconds = lambda key: (f"{r[f'{key}_s']:.2f} s  ({r[f'{key}_spread_s'][0]:.2f}..{r[f'{key}_spread_s'][1]:.2f})")  # noqa: E731
        rows += [
            ("pool start, workers forked from the template", seconds("start_template")),
            ("pool start, each worker importing its code", seconds("start_fresh")),
            ("importing / forked", f"{r['start_ratio']:.1f}x"),
        ]
    width = max(len(name) for name, _ in rows)
    lines = [f"pool: {config.describe()}", "-" * (width + 30)]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, float]:
    """Run the benchmark described by ``args`` (see :func:`add_arguments`), print a table, return the numbers."""
    config = ParallelConfig(world=args.world, devices=args.devices, backend=args.backend)
    shape = (args.frames, args.height, args.width, 3)
    if args.start_repeats < 0:
        raise ValueError(f"--start-repeats must be 0 or more, got {args.start_repeats}")
    if min(shape) < 1 or min(args.repeats, args.empty_repeats, args.chunk_frames, args.chunk_repeats) < 1:
        raise ValueError(f"frames, height, width, chunk frames and repeats must be positive, got shape {shape}, "
                         f"repeats {args.repeats}, empty repeats {args.empty_repeats}, chunk frames "
                         f"{args.chunk_frames}, chunk repeats {args.chunk_repeats}")
    image = torch.rand(shape, dtype=torch.float32)
    starts = args.start_repeats and all(device.startswith("cpu") for device in config.rank_devices())
    run = measured_runs(4 if starts else 3)
    with WorkerPool(config) as pool:
        results = measure(pool, image, args.repeats, args.empty_repeats, run)
    run(f"{args.chunk_repeats} chunk hand-overs per transport")
    results.update(measure_chunk_handover(args.chunk_frames, args.height, args.width, args.chunk_repeats))
    if starts:
        run(f"{args.start_repeats + 1} pool starts per way of starting")
        results.update(measure_pool_starts(config, args.start_repeats))
    print(format_table(config, shape, results))
    if args.json is not None:
        args.json.write_text(json.dumps({"config": config.to_dict(), "shape": shape, **results}, indent=2))
    return results
