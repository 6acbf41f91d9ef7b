"""Calibration of the auto layout's cost model on this machine; run from the driver (CLI, ComfyUI, bench plan).

A short probe (well under 20 s on CPU ranks) starts ``world`` ranks on the pool's devices, the same way the pool
does (gloo on CPU ranks, each with its share of the cores; NCCL on GPUs), and measures: a rank's matmul throughput
with 1, 2, ... of the ranks busy at once (CPU ranks share cores and memory bandwidth), attention throughput with
every rank busy, and the latency and bandwidth of all-reduce, all-to-all and neighbour send/receive within groups
of every size dividing the world, all groups at once, at two message sizes (latency from the small one, bandwidth
from the difference), per group size what a call costs when every rank computes between calls (the busy
latency), and the cores and threads CPU ranks compute with (what idle ranks can give the busy ones). Speeds are
timed over a sustained window, not per call, so ranks that share cores are timed over many scheduler slices, and
each is the fastest of three interleaved rounds (a slow spell on a shared machine only ever slows a reading).
The result is cached as JSON per machine, device set and world (``$WANMESH_CACHE/calibration/``, readable by
users; a cache of an older probe is probed again); ``reprobe=True`` (``--reprobe``) measures again. Ranks of
different speeds (a mixed GPU set) are named in the log.

Ranks on several hosts (a Ray pool placed by host): each rank says its host (its Ray node's address), and the
probe also times each collective between two ranks of one host and between rank 0 and a rank of another host,
one pair at a time (``host_links``), so the cost model prices the groups that cross hosts on the slower link. A
Ray pool is calibrated by its own actors (a short-lived pool when no running pool is given), its figures cached
under the cluster's address.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from .auto_layout import Job, Link, Machine, ModelCost, Prediction, choose
from .config import ParallelConfig, cache_root
from .video_io import written_atomically

log = logging.getLogger("wanmesh")
PROBE_DEADLINE_S = 60.0
PROBE_VERSION = 7  # what the cached figures hold; a cache written by another version is probed again
PROBE_SIZES = (1 << 12, 1 << 20)  # float32 elements of the small and large messages
MATMUL_SHAPE = (1024, 512)  # [tokens, dim] x [dim, dim], the shape of a small transformer block's projections
ATTENTION_SHAPE = (4, 512, 64)  # heads, tokens, head dim
SPEED_SPREAD_WARNING = 1.25  # ranks slower than the fastest by this factor are named
BUSY_CALLS = 16  # compute-and-collective rounds of the busy-latency probe
LINK_KINDS = ("all_reduce", "all_to_all", "send_recv")
SUSTAINED_S = {"cpu": 0.3, "cuda": 0.05}  # how long each speed is measured: many scheduler slices on CPU ranks
SPEED_ROUNDS = 3  # interleaved rounds of the speed probes; the fastest counts
GPU_RING_OVERLAP = 0.8  # the share of ring attention's exchanges NCCL streams hide behind the attention compute


def cache_file(config: ParallelConfig) -> Path:
    devices = "-".join(config.rank_devices()).replace(":", "")
    where = platform.node() or "machine"
    if config.backend == "ray":
        where = "ray-" + "".join(c if c.isalnum() or c == "." else "_" for c in config.ray_address or "auto")
    return cache_root() / "calibration" / f"{where}-{devices}-world{config.world}.json"


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
            figures = json.loads(path.read_text())
            if figures.get("version") == PROBE_VERSION:
                return machine_from_dict(figures)
            log.info("calibration %s is from an older probe; probing again", path)
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("calibration %s is unreadable; probing again", path)
    started = time.perf_counter()
    figures = combine(config, runner.calibrate() if runner is not None else probe_ranks(config))
    if figures.get("hosts"):
        log.info("calibrated links on %d hosts: %s", len(set(figures["hosts"])), _host_links_text(figures))
    figures["probe_s"], figures["version"] = round(time.perf_counter() - started, 2), PROBE_VERSION
    with written_atomically(path) as temporary:
        temporary.write_text(json.dumps(figures, indent=2))
    log.info("calibrated %s in %.1f s: %s", ", ".join(config.rank_devices()), figures["probe_s"], path)
    return machine_from_dict(figures)


def machine_from_dict(figures: dict) -> Machine:
    links = {name: Link(**figures[name]) for name in LINK_KINDS}
    groups, alone = ((tuple((int(size), name, Link(**kinds[name]))
                            for size, kinds in figures.get(key, {}).items() for name in LINK_KINDS))
                     for key in ("group_links", "group_links_alone"))
    return Machine(matmul_flops=figures["matmul_flops"], attention_flops=figures["attention_flops"],
                   matmul_flops_alone=figures.get("matmul_flops_alone", figures["matmul_flops"]),
                   matmul_flops_by_active=tuple(sorted((int(active), flops) for active, flops
                                                       in figures.get("matmul_flops_by_active", {}).items())),
                   free_bytes=int(figures["free_bytes"]), element_bytes=int(figures["element_bytes"]),
                   overlap=float(figures["overlap"]), group_links=groups,
                   group_links_alone=alone,
                   busy_latency_s=float(figures.get("busy_latency_s", 0.0)),
                   busy_latencies=tuple(sorted((int(size), float(seconds))
                                               for size, seconds in figures.get("busy_latencies", {}).items())),
                   cpu_cores=int(figures.get("cpu_cores", 0)), rank_threads=int(figures.get("rank_threads", 1)),
                   rank_hosts=tuple(int(h) for h in figures.get("rank_hosts", ())),
                   host_links=tuple((where, name, Link(**kinds[name]))
                                    for where, kinds in figures.get("host_links", {}).items() for name in LINK_KINDS),
                   **links)


def _host_links_text(figures: dict) -> str:
    return "; ".join(f"{where}: all-reduce {kinds['all_reduce']['latency_s'] * 1e3:.3f} ms + "
                     f"{kinds['all_reduce']['bytes_per_s'] / 1e9:.2f} GB/s"
                     for where, kinds in figures.get("host_links", {}).items())


def probe_ranks(config: ParallelConfig) -> list[dict]:
    """Each rank's figures, measured on ``config.world`` fresh ranks on the pool's devices (on a Ray pool: a
    short-lived pool's actors, wherever Ray places them)."""
    from .distributed.spawn import spawn_ranks

    if config.backend == "ray":
        from .driver.pool import WorkerPool
        from .driver.runner import PoolRunner

        with WorkerPool(config) as pool:
            return PoolRunner(pool).calibrate()
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
    by_active = {active: min(rank["matmul_flops_by_active"][active] for rank in ranks)
                 for active in ranks[0].get("matmul_flops_by_active", {})}
    memory = config.memory_budget_gb * 2**30 if config.memory_budget_gb else slowest["free_bytes"]
    busy = {size: max(rank["busy_latencies"][size] for rank in ranks) for size in ranks[0]["busy_latencies"]}
    return {"devices": devices, "world": config.world, "matmul_flops": slowest["matmul_flops"],
            "matmul_flops_alone": slowest["matmul_flops_alone"], "matmul_flops_by_active": by_active,
            "attention_flops": slowest["attention_flops"], "free_bytes": int(min(memory, slowest["free_bytes"])),
            "element_bytes": 2 if cuda else 4, "overlap": GPU_RING_OVERLAP if cuda else 0.0,
            **ranks[0]["group_links"].get(str(config.world), _no_links()), "group_links": ranks[0]["group_links"],
            "group_links_alone": ranks[0].get("group_links_alone", {}),
            "busy_latency_s": busy.get(str(config.world), 0.0), "busy_latencies": busy,
            "cpu_cores": 0 if cuda else ranks[0]["cpu_cores"], "rank_threads": ranks[0]["threads"],
            **_hosts(ranks)}


def _hosts(ranks: list[dict]) -> dict:
    """On several hosts: each rank's host, its index (first seen first) and the pairs' links; else nothing."""
    hosts = [rank.get("host", "") for rank in ranks]
    if len(set(hosts)) < 2:
        return {}
    index = {host: number for number, host in enumerate(dict.fromkeys(hosts))}
    return {"hosts": hosts, "rank_hosts": [index[host] for host in hosts], "host_links": ranks[0].get("host_links", {})}


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
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _write_rank_figures(rank: int, world: int, folder: str, cuda: bool) -> None:
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps(measure_rank(world, device)))


def measure_rank(world: int, device: torch.device) -> dict:
    """This rank's matmul speed with 1, 2, ... ranks busy at once, its attention speed with every rank busy, its free
    memory and (world > 1) the links; every rank of the default process group calls it at once (a fresh probe
    world, or the pool's workers)."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens, dim = MATMUL_SHAPE if not cuda else (MATMUL_SHAPE[0] * 8, MATMUL_SHAPE[1] * 4)
    a, b = torch.randn(tokens, dim, device=device, dtype=dtype), torch.randn(dim, dim, device=device, dtype=dtype)
    window = SUSTAINED_S["cuda" if cuda else "cpu"]
    heads, length, head_dim = ATTENTION_SHAPE
    q = torch.randn(1, heads, length * (4 if cuda else 1), head_dim, device=device, dtype=dtype)
    matmul_s, attention_s = _fastest_of_rounds(
        lambda: _sustained(lambda: a @ b, device, window),
        lambda: _sustained(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q), device, window),
        world, _barrier(world))
    by_active = {active: 2 * tokens * dim * dim / seconds for active, seconds in matmul_s.items()}
    links, alone, busy = (_group_links(world, device, 20 if cuda else 9, lambda: a @ b) if world > 1
                          else ({}, {}, {}))
    host = rank_host()
    hosts = _gathered(host, world)
    return {"matmul_flops": by_active[world], "matmul_flops_alone": by_active[1],
            "matmul_flops_by_active": {str(active): flops for active, flops in by_active.items()},
            "attention_flops": 4 * q.shape[2] ** 2 * heads * head_dim / attention_s,
            "free_bytes": _free_bytes(device, world),
            "group_links": links, "group_links_alone": alone, "busy_latencies": busy, "cpu_cores": os.cpu_count() or 1,
            "threads": torch.get_num_threads(), "host": host,
            "host_links": _host_pair_links(hosts, device, 20 if cuda else 9) if len(set(hosts)) > 1 else {}}


def rank_host() -> str:
    """The host this rank runs on: its Ray node's address in a Ray actor (hosts may share a name), else the
    machine's name."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return platform.node() or "machine"


def _gathered(value, world: int) -> list:
    if world == 1:
        return [value]
    import torch.distributed as dist

    gathered: list = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered


def _host_pair_links(hosts: list[str], device: torch.device, repeats: int) -> dict[str, dict]:
    """Each collective kind's price between rank 0 and the next rank of its own host ("inside", when it has one)
    and between rank 0 and the first rank of another host ("across"), one pair at a time while the others wait;
    every rank calls it (every rank creates every group)."""
    import torch.distributed as dist

    rank, prices = dist.get_rank(), {}
    pairs = {"inside": next((r for r in range(1, len(hosts)) if hosts[r] == hosts[0]), None),
             "across": next(r for r in range(1, len(hosts)) if hosts[r] != hosts[0])}
    for where, peer in pairs.items():
        if peer is None:
            continue
        group = dist.new_group([0, peer])
        if rank in (0, peer):
            prices[where] = _links([0, peer], group, device, repeats, lambda: dist.barrier(group=group))
        dist.barrier()
        dist.destroy_process_group(group)
    return prices


def _busy_latency(compute, device: torch.device, group) -> float:
    """Seconds a small all-reduce within ``group`` adds when every rank computes between calls, as in a step:
    rounds of ``compute`` with and without the all-reduce after each call, interleaved. On ranks that share cores
    a rank waits there until its partners have had their turn on one, which an idle probe never sees."""
    small = torch.ones(PROBE_SIZES[0], device=device)

    def seconds_per_call(with_collective: bool) -> float:
        torch.distributed.barrier()
        start = time.perf_counter()
        for _ in range(BUSY_CALLS):
            compute()
            if with_collective:
                torch.distributed.all_reduce(small, group=group)
        _synchronize(device)
        return (time.perf_counter() - start) / BUSY_CALLS

    rounds = [(seconds_per_call(True), seconds_per_call(False)) for _ in range(2)]
    return max(0.0, statistics.median(busy - plain for busy, plain in rounds))


def _fastest_of_rounds(matmul, attention, world: int, barrier) -> tuple[dict[int, float], float]:
    """Seconds of ``matmul()`` per number of busy ranks (``_by_active``) and of ``attention()`` with every rank
    busy, each the fastest of ``SPEED_ROUNDS`` interleaved rounds. On a shared machine (a VM beside other
    tenants) one window can read 1.5x slow; a disturbance only ever slows a reading down, so the fastest round is
    the machine's own speed, and interleaving keeps one slow spell from falling on one setting only."""
    rounds = []
    for _ in range(SPEED_ROUNDS):
        by_active = _by_active(matmul, world, barrier)
        barrier()  # every rank computes at once
        rounds.append((by_active, attention()))
    fastest = {active: min(by_active[active] for by_active, _ in rounds) for active in rounds[0][0]}
    return fastest, min(seconds for _, seconds in rounds)


def _by_active(measure, world: int, barrier) -> dict[int, float]:
    """``measure()`` with ``active`` ranks busy at once, for every ``active`` dividing ``world``: the ranks take
    turns in groups of ``active`` while the others wait at a barrier (CPU ranks share the machine's cores and
    memory bandwidth, so a rank computes slower the more ranks compute beside it)."""
    rank = torch.distributed.get_rank() if world > 1 else 0
    results = {}
    for active in (d for d in range(1, world + 1) if world % d == 0):
        for turn in range(world // active):
            barrier()
            if rank // active == turn:
                results[active] = measure()
        barrier()
    return results


def _sustained(fn, device: torch.device, seconds: float) -> float:
    """Seconds per call of ``fn`` run back to back for ``seconds`` after one warm-up call. A per-call median would
    favour the calls a rank made while the ranks sharing its cores waited for theirs; over a window of many
    scheduler slices every busy rank gets its share."""
    fn()
    _synchronize(device)
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        _synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(world: int):
    if world == 1:
        return lambda: None
    import torch.distributed as dist

    return dist.barrier


def _no_links() -> dict:
    return {name: {"latency_s": 0.0, "bytes_per_s": float("inf")} for name in LINK_KINDS}


def _group_links(world: int, device: torch.device, repeats: int,
                 compute) -> tuple[dict[str, dict], dict[str, dict], dict[str, float]]:
    """Each collective kind's price within groups of every size dividing ``world`` (consecutive ranks, every group
    at once, as a layout's tp, Ulysses or ring groups run): a 2-rank all-reduce inside 4 ranks is not priced as
    a 4-rank one; the same within the first group alone while the others wait (a layout whose replicas wait for
    a batch row: on four ranks and two cores a pair's exchange read 0.23 to 3.8 ms with both pairs at once and
    0.12 to 0.24 ms alone); and the busy latency within groups of each size (``_busy_latency``)."""
    import torch.distributed as dist

    rank, prices, alone, busy = dist.get_rank(), {}, {}, {}
    for size in (d for d in range(2, world + 1) if world % d == 0):
        groups = [dist.new_group(list(range(first, first + size))) if size < world else None
                  for first in range(0, world, size)]  # every rank creates every group, in the same order
        members, group = list(range(rank // size * size, rank // size * size + size)), groups[rank // size]
        prices[str(size)] = _links(members, group, device, repeats, dist.barrier)
        if size < world:
            if rank < size:
                alone[str(size)] = _links(members, group, device, repeats, lambda: dist.barrier(group=group))
            dist.barrier()
        busy[str(size)] = _busy_latency(compute, device, group)
        if group is not None:  # a pool's workers calibrate too: their own groups stay as they were
            dist.destroy_process_group(group)
    return prices, alone, busy


def _links(members: list[int], group, device: torch.device, repeats: int, barrier) -> dict:
    """Latency and bandwidth of each collective kind within ``group`` (its global ranks ``members``), from a small
    and a large message; ``barrier()`` lines up the ranks taking part before each."""
    import torch.distributed as dist

    size, position = len(members), members.index(dist.get_rank())
    peer_next, peer_previous = members[(position + 1) % size], members[(position - 1) % size]

    def send_recv(tensor: torch.Tensor, into: torch.Tensor) -> None:
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer_next, group),
                                           dist.P2POp(dist.irecv, into, peer_previous, group)])
        for request in requests:
            request.wait()

    kinds = {"all_reduce": (lambda t, _: dist.all_reduce(t, group=group), lambda n: 2 * (size - 1) * n // size),
             "all_to_all": (lambda t, into: dist.all_to_all_single(into, t, group=group),
                            lambda n: (size - 1) * n // size),
             "send_recv": (send_recv, lambda n: n)}
    links = {}
    for name, (operation, moved) in kinds.items():
        seconds = []
        for elements in PROBE_SIZES:
            tensor = torch.ones(elements * size, device=device)
            into = torch.empty_like(tensor)
            barrier()
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
