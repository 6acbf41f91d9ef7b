"""The driver of the two-host tests, run as its own process inside the first host's network namespace: it
starts WanMesh pools, samples with the tiny model, and writes what it saw to a JSON file.

``lose SPEC OUT``: a local world-1 pool samples the seeded request (the reference); a world-4 Ray pool (tp 2,
CFG parallel) samples it too (OUT.json gets each rank's host, the interfaces gloo binds to, the store's address
and the largest difference to the reference), then samples a long request during which, at step 2, the second
host's raylet (SPEC's ``raylet_pid``) is killed; OUT.json gets the error and how long it took, the next call's
error on the same pool, and the pool's actor processes left on this host.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import torch

from wanmesh.parallel.config import ParallelConfig, latent_shape
from wanmesh.parallel.driver.pool import WorkerError, WorkerPool
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.protocol import SampleRequest

LEFTOVER_WAIT_S = 15.0


def seeded_request(steps: int) -> SampleRequest:
    embeddings = [torch.randn(6, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    return SampleRequest(handle="", latent=torch.zeros(latent_shape(64, 48, 5)), positive=embeddings[:1],
                         negative=embeddings[1:], seed=7, steps=steps, guidance_scale=4.0, shift=3.0, sampler="unipc")


def open_pool(spec: dict, **layout) -> WorkerPool:
    config = ParallelConfig(devices="cpu", backend=spec["backend"], ray_address=spec.get("address"), **layout)
    return WorkerPool(config, timeout_s=240, start_timeout_s=120)


def sample(pool: WorkerPool, model: str, steps: int, progress=None) -> torch.Tensor:
    runner = PoolRunner(pool)
    handle = runner.load_model(model)
    return runner.sample(replace(seeded_request(steps), handle=handle), progress=progress)


def placement(pool: WorkerPool) -> dict:
    backend = pool._backend
    if not hasattr(backend, "hosts"):
        return {}
    return {"hosts": backend.hosts, "interfaces": backend.interfaces, "store": backend.store_address,
            "driver": backend.driver_host, "text": backend.placement_text()}


def our_actor_processes() -> list[str]:
    """Command lines of the pool's actor processes in this network namespace."""
    here = os.readlink("/proc/self/ns/net")
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.readlink(f"/proc/{proc.pid}/ns/net") == here and "RayWorker" in " ".join(proc.info["cmdline"] or []):
                found.append(" ".join(proc.info["cmdline"])[:120])
        except (OSError, psutil.Error):
            continue
    return found


def run_lose(spec: dict, out: Path) -> None:
    report: dict = {}
    killed: list[float] = []

    def kill_at_step_two(step: int, total: int, *rest) -> None:
        if step == 2 and not killed:
            os.kill(spec["raylet_pid"], signal.SIGKILL)
            killed.append(time.monotonic())

    with open_pool({"backend": "local"}, world=1) as pool:
        reference = sample(pool, spec["model"], spec["steps"])
    with open_pool(spec, world=4, tp=2, cfg_parallel=True) as pool:
        report["placement"] = placement(pool)
        latents = sample(pool, spec["model"], spec["steps"])
        report["difference"] = (latents - reference).abs().max().item()
        report["reference_std"] = reference.std().item()
        try:
            sample(pool, spec["model"], 200, progress=kill_at_step_two)
            report["error"] = None
        except WorkerError as error:
            report["error"] = str(error)
            report["error_after_s"] = time.monotonic() - killed[0] if killed else None
        try:
            sample(pool, spec["model"], spec["steps"])
            report["next"] = "ran"
        except (ValueError, WorkerError) as error:
            report["next"] = f"{type(error).__name__}: {error}"
        deadline = time.monotonic() + LEFTOVER_WAIT_S
        while our_actor_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        report["leftovers"] = our_actor_processes()
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    mode, spec_text, out_path = sys.argv[1:4]
    {"lose": run_lose}[mode](json.loads(spec_text), Path(out_path))
