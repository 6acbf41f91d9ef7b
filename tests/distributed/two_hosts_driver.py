"""The driver of the two-host tests, run as its own process inside the first host's network namespace: it
starts WanMesh pools, samples with the tiny model, and writes what it saw to a JSON file.

``lose SPEC OUT``: a local world-1 pool samples the seeded request (the reference); a world-4 Ray pool (tp 2,
CFG parallel) samples it too (OUT.json gets each rank's host, the interfaces gloo binds to, the store's address
and the largest difference to the reference), then samples a long request during which, at step 2, the second
host's raylet (SPEC's ``raylet_pid``) is killed; OUT.json gets the error and how long it took, the next call's
error on the same pool, and the pool's actor processes left on this host.

``comfy SPEC OUT``: a ComfyUI server (``tests/tools/comfyui_server.py``) started here runs a WanMesh prompt whose
Pool node has backend ray and the head's address (world 4: tp 2, CFG parallel); at the sampler's step 2 the second
host is taken away, for each of SPEC's ``variants``: ``raylet`` (its raylet killed) or ``link`` (its end of the
veth pair down), the second host revived between variants (``two_hosts.revive_worker``). OUT.json gets, per
variant, the prompt's error messages and how long after the loss it ended, whether the server still answers,
the next prompt's outcome, and the pool's actor processes left on this host; and what the server left behind.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

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


LONG_STEPS = 400  # at 32x32, 5 frames: many seconds of sampling, so step 2 comes long before the end
PROMPT_TIMEOUT_S = 240.0


def pool_prompt(address: str, steps: int) -> dict:
    from workflow_graph import load_workflow, with_fresh_seed, with_inputs

    prompt = with_inputs(load_workflow("api/t2v.json"), "WanMeshPool", backend="ray", ray_address=address,
                         devices="cpu", world=4, tp=2, cfg_parallel=True, previews=False)
    prompt = with_inputs(prompt, "WanMeshSampler", steps=steps)
    return with_fresh_seed(with_inputs(prompt, "WanMeshEmptyLatent", width=32, height=32, length=5))


def errors_of(result) -> list[str]:
    messages = getattr(result, "messages", [])
    return [data.get("exception_message", "") for event, data in messages if event == "execution_error"]


def lose_host_mid_prompt(server, hosts, variant: str) -> dict:
    """One long prompt; at the sampler's step 2 the second host is taken away (``variant``); what followed."""
    from two_hosts import set_link

    prompt = pool_prompt(hosts.address, LONG_STEPS)
    sampler = next(node_id for node_id, node in prompt.items() if node["class_type"] == "WanMeshSampler")
    with server.listen() as listener:
        prompt_id = server.submit(prompt, client_id=listener.client_id)
        listener.wait_for(lambda e: e.kind == "progress" and e.data.get("node") == sampler
                          and e.data.get("value", 0) >= 2, PROMPT_TIMEOUT_S, "the sampler's step 2")
        if variant == "raylet":
            os.kill(hosts.worker.raylet_pid(), signal.SIGKILL)
        else:
            set_link(hosts.worker, False)
        lost_at = time.monotonic()
        result = server.wait_for(prompt_id, PROMPT_TIMEOUT_S)
        ended_after_s = time.monotonic() - lost_at
    report = {"status": result.status, "errors": errors_of(result), "ended_after_s": ended_after_s,
              "answers": isinstance(server.get_json("/object_info/WanMeshPool"), dict)}
    following = server.run(pool_prompt(hosts.address, 1), PROMPT_TIMEOUT_S)
    report["next"] = {"status": getattr(following, "status", "rejected"), "errors": errors_of(following)}
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while our_actor_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    report["leftovers"] = our_actor_processes()
    return report


def run_comfy(spec: dict, out: Path) -> None:
    from comfyui_server import ComfyUIServer, write_model_paths_config
    from two_hosts import TwoHosts, revive_worker

    hosts = TwoHosts.from_dict(spec["hosts"])
    work = Path(spec["work_dir"])
    config = write_model_paths_config(Path(spec["models"]), work / "extra_model_paths.yaml")
    server = ComfyUIServer(Path(spec["comfy_dir"]), work, config, extra_env={"OMP_NUM_THREADS": "1", **hosts.env})
    report: dict = {"variants": {}}
    try:
        server.start()
        for index, variant in enumerate(spec["variants"]):
            if index:
                revive_worker(hosts)
            report["variants"][variant] = lose_host_mid_prompt(server, hosts, variant)
    finally:
        report["left_behind"] = server.stop()
        report["log_tail"] = server.log()[-3000:]
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    mode, spec_text, out_path = sys.argv[1:4]
    {"lose": run_lose, "comfy": run_comfy}[mode](json.loads(spec_text), Path(out_path))
