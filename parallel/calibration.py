"""Calibration of the auto layout's cost model on this machine; run from the driver (CLI, ComfyUI, bench plan).

A short probe (well under 20 s on CPU ranks) starts ``world`` ranks on the pool's devices, the same way the pool
does (gloo on CPU ranks, each with its share of the cores; NCCL on GPUs), and measures with every rank busy at
once: matmul and attention throughput per rank, and the latency and bandwidth of all-reduce, all-to-all and
neighbour send/receive at two message sizes (latency from the small one, bandwidth from the difference). The
result is cached as JSON per machine, device set and world (``$WANMESH_CACHE/calibration/``, readable by users);
``reprobe=True`` (``--reprobe``) measures again. Ranks of different speeds (a mixed GPU set) are named in the log.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .auto_layout import Job, Link, Machine, ModelCost, Prediction, choose
from .config import ParallelConfig, cache_root
from .video_io import written_atomically

log = logging.getLogger("wanmesh")
PROBE_DEADLINE_S = 60.0
PROBE_SIZES = (1 << 12, 1 << 20)  # float32 elements of the small and large messages
MATMUL_SHAPE = (1024, 512)  # [tokens, dim] x [dim, dim], the shape of a small transformer block's projections
ATTENTION_SHAPE = (4, 512, 64)  # heads, tokens, head dim
SPEED_SPREAD_WARNING = 1.25  # ranks slower than the fastest by this factor are named


def cache_file(config: ParallelConfig) -> Path:
    devices = "-".join(config.rank_devices()).replace(":", "")
    return cache_root() / "calibration" / f"{platform.node() or 'machine'}-{devices}-world{config.world}.json"


def choose_layout(config: ParallelConfig, model_path: str, job: Job, *, streaming: bool, reprobe: bool = False,
                  runner=None) -> list[Prediction]:
    """The layouts ``config.world`` ranks can run ``job`` with, ranked by the cost model on this machine's
    figures (``machine_for``); the first is the choice."""
    machine = machine_for(config, reprobe=reprobe, runner=runner)
    return choose(config.world, ModelCost.from_file(model_path), job, machine, streaming=streaming)


def machine_for(config: ParallelConfig, *, reprobe: bool = False, runner=None) -> Machine:
    """The calibrated machine for this pool's devices: from the cache, or probed now (and cached): by the
    running pool's own workers when ``runner`` is given (a ``Calibrate`` request), else by fresh ranks."""
    path = cache_file(config)
    if path.is_file() and not reprobe:
        try:
            return machine_from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            log.warning("calibration %s is unreadable; probing again", path)
    started = time.perf_counter()
    figures = combine(config, runner.calibrate() if runner is not None else probe_ranks(config))
    figures["probe_s"] = round(time.perf_counter() - started, 2)
    with written_atomically(path) as temporary:
        temporary.write_text(json.dumps(figures, indent=2))
    log.info("calibrated %s in %.1f s: %s", ", ".join(config.rank_devices()), figures["probe_s"], path)
    return machine_from_dict(figures)


def machine_from_dict(figures: dict) -> Machine:
    links = {name: Link(**figures[name]) for name in ("all_reduce", "all_to_all", "send_recv")}
    return Machine(matmul_flops=figures["matmul_flops"], attention_flops=figures["attention_flops"],
                   matmul_flops_alone=figures.get("matmul_flops_alone", figures["matmul_flops"]),
                   free_bytes=int(figures["free_bytes"]), element_bytes=int(figures["element_bytes"]),
                   overlap=float(figures["overlap"]), **links)


def probe_ranks(config: ParallelConfig) -> list[dict]:
    """Each rank's figures, measured on ``config.world`` fresh ranks on the pool's devices."""
    from .distributed.spawn import spawn_ranks

    cuda = config.rank_devices()[0].startswith("cuda")
    threads = max(1, (os.cpu_count() or 1) // config.world)
    with tempfile.TemporaryDirectory() as folder:
        if config.world == 1:
            _write_rank_figures(0, 1, folder, cuda)
        else:
            spawn_ranks(_write_rank_figures, config.world, args=(folder, cuda), device="cuda" if cuda else "cpu",
                        deadline_s=PROBE_DEADLINE_S, threads=threads)
        return [json.loads((Path(folder) / f"rank{rank}.json").read_text()) for rank in range(config.world)]


def combine(config: ParallelConfig, ranks: list[dict]) -> dict:
    """The machine's figures from every rank's: the slowest rank's speeds and free memory, rank 0's links."""
    devices = config.rank_devices()
    cuda = devices[0].startswith("cuda")
    if cuda:  # CPU ranks are one kind of core: their spread is noise, not a slower device
        _name_slow_ranks(ranks, devices)
    slowest = {key: min(rank.get(key, rank["matmul_flops"]) for rank in ranks)
               for key in ("matmul_flops", "matmul_flops_alone", "attention_flops", "free_bytes")}
    memory = config.memory_budget_gb * 2**30 if config.memory_budget_gb else slowest["free_bytes"]
    return {"devices": devices, "world": config.world, "matmul_flops": slowest["matmul_flops"],
            "matmul_flops_alone": slowest["matmul_flops_alone"],
            "attention_flops": slowest["attention_flops"], "free_bytes": int(min(memory, slowest["free_bytes"])),
            "element_bytes": 2 if cuda else 4, "overlap": 0.8 if cuda else 0.0, **ranks[0]["links"]}


def _name_slow_ranks(ranks: list[dict], devices: list[str]) -> None:
    fastest = max(rank["matmul_flops"] for rank in ranks)
    slow = [f"rank {index} ({devices[index]}: {rank['matmul_flops'] / 1e9:.1f} GFLOP/s)"
            for index, rank in enumerate(ranks) if rank["matmul_flops"] * SPEED_SPREAD_WARNING < fastest]
    if slow:
        log.warning("ranks of different speeds: %s against %.1f GFLOP/s; the auto layout plans for the slowest",
                    ", ".join(slow), fastest / 1e9)


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _write_rank_figures(rank: int, world: int, folder: str, cuda: bool) -> None:
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(measure_rank(world, device)))


def measure_rank(world: int, device: torch.device) -> dict:
    """This rank's matmul and attention speed with every rank busy, its free memory and (world > 1) the links;
    every rank of the default process group calls it at once (a fresh probe world, or the pool's workers)."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    repeats = 20 if cuda else 5
    tokens, dim = MATMUL_SHAPE if not cuda else (MATMUL_SHAPE[0] * 8, MATMUL_SHAPE[1] * 4)
    a, b = torch.randn(tokens, dim, device=device, dtype=dtype), torch.randn(dim, dim, device=device, dtype=dtype)
    barrier = _barrier(world)
    barrier()  # every rank computes at once: CPU ranks share the machine's cores and memory bandwidth
    matmul_s = _timed(lambda: a @ b, device, repeats)
    barrier()  # then each rank alone, the others waiting: what a rank gets when idle ranks leave it the cores
    alone_s = _alone(lambda: _timed(lambda: a @ b, device, repeats), world, barrier)
    heads, length, head_dim = ATTENTION_SHAPE
    q = torch.randn(1, heads, length * (4 if cuda else 1), head_dim, device=device, dtype=dtype)
    attention_s = _timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q), device, repeats)
    return {"matmul_flops": 2 * tokens * dim * dim / matmul_s, "matmul_flops_alone": 2 * tokens * dim * dim / alone_s,
            "attention_flops": 4 * q.shape[2] ** 2 * heads * head_dim / attention_s,
            "free_bytes": _free_bytes(device, world),
            "links": _links(world, device, repeats) if world > 1 else _no_links()}


def _alone(measure, world: int, barrier) -> float:
    """``measure()`` on each rank in turn while the others wait at a barrier."""
    import torch.distributed as dist

    rank = dist.get_rank() if world > 1 else 0
    result = 0.0
    for turn in range(world):
        if turn == rank:
            result = measure()
        barrier()
    return result


def _barrier(world: int):
    if world == 1:
        return lambda: None
    import torch.distributed as dist

    return dist.barrier


def _no_links() -> dict:
    return {name: {"latency_s": 0.0, "bytes_per_s": float("inf")} for name in ("all_reduce", "all_to_all", "send_recv")}


def _links(world: int, device: torch.device, repeats: int) -> dict:
    """Latency and bandwidth of each collective kind, from a small and a large message."""
    import torch.distributed as dist

    rank = dist.get_rank()
    peer_next, peer_previous = (rank + 1) % world, (rank - 1) % world

    def send_recv(tensor: torch.Tensor, into: torch.Tensor) -> None:
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer_next),
                                           dist.P2POp(dist.irecv, into, peer_previous)])
        for request in requests:
            request.wait()

    kinds = {"all_reduce": (lambda t, _: dist.all_reduce(t), lambda n: 2 * (world - 1) * n // world),
             "all_to_all": (lambda t, into: dist.all_to_all_single(into, t), lambda n: (world - 1) * n // world),
             "send_recv": (send_recv, lambda n: n)}
    links = {}
    for name, (operation, moved) in kinds.items():
        seconds = []
        for elements in PROBE_SIZES:
            tensor = torch.ones(elements * world, device=device)
            into = torch.empty_like(tensor)
            dist.barrier()
            seconds.append((moved(tensor.numel() * 4), _timed(lambda: operation(tensor, into), device, repeats)))
        (small_bytes, small_s), (large_bytes, large_s) = seconds
        bandwidth = (large_bytes - small_bytes) / max(large_s - small_s, 1e-9)
        links[name] = {"latency_s": max(small_s - small_bytes / bandwidth, 1e-7), "bytes_per_s": bandwidth}
    return links


def _free_bytes(device: torch.device, world: int) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    from .worker.memory import machine_ram_bytes

    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    return int((available or machine_ram_bytes()) // world)
