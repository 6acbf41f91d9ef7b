"""ComfyUI's "unload models" / "free memory" (POST /free) on a real server reach the WanMesh pool, many
prompts in a row do not grow the workers' memory, and switching among model files keeps the workers' memory
within the Pool node's memory budget.

unload_models: the pool's models are unloaded while its workers stay up (logged), and each worker's RSS comes
back to within 64 MiB of a freshly started worker's (a pool of the same layout started by the test); the next
prompt loads what it needs again in the same workers. free_memory: the worker processes exit; the next prompt
starts a fresh pool.

Switching: three model files of 67 MiB, A, B, C, A, B, C. With the Pool node's memory budget at about 1.5 files
per rank the workers' RSS stays within one file each of its level after A, and the workers log each unload; the
control (default budget, A, B, C) shows the RSS growing past that bound. The tests run in file order so the
pools are shared: the control starts the module's first pool, and the prompts after free_memory already carry
the budget, so the budget test needs no pool restart.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

import psutil
import pytest
from comfyui_server import ComfyUIServer
from wide_models import MIB, wide_ffn_dim, write_wide_t2v
from workflow_graph import load_workflow, node_of_type, with_fresh_seed, with_inputs

from wanmesh.parallel.bench.soak import worker_processes
from wanmesh.parallel.config import ParallelConfig
from wanmesh.parallel.driver.pool import WorkerPool

PROMPT_TIMEOUT_S = 300.0
EXIT_DEADLINE_S = 60.0
PROMPTS_IN_A_ROW = 50
WARM_UP_PROMPTS = 10  # allocator and caches settle before the baseline is taken
MAX_GROWTH = 0.05
SWITCH_MODEL_MIB = 64  # each of the three model files: well above the noise of a worker's RSS
SWITCH_SEEDS = (101, 102, 103)
# Per rank: one switched model file (with the tiny text encoder and VAE) fits, two do not.
SWITCH_BUDGET_GB = 1.5 * SWITCH_MODEL_MIB * 2**20 / 1e9
# The Pool node's budget from the fresh pool after free_memory on, so the budget test reuses that pool (a changed
# budget restarts the pool, tens of seconds); it is far above what the tiny models take.
BUDGET_POOL = dict(memory_budget_gb=SWITCH_BUDGET_GB)
UNLOAD_ROUNDS = 10
UNLOADED_WITHIN_MIB = 64  # of a fresh worker's RSS, and of the first unload's
REPOST_S = 5.0  # see free_until
UNLOAD_LOG = "unloaded the worker pool's models (its workers stay up"
EVICTION_LOG = "memory budget"  # the worker's warning when the budget unloads a model (residency.py)


@pytest.fixture(scope="module")
def comfyui_server(own_comfyui_server: ComfyUIServer) -> ComfyUIServer:
    """This module's own server: it measures the workers' memory and pools from a server that ran nothing else."""
    return own_comfyui_server


def quick_prompt(**pool_inputs) -> dict:
    prompt = with_inputs(load_workflow("api/t2v.json"), "WanMeshSampler", steps=1)
    if pool_inputs:
        prompt = with_inputs(prompt, "WanMeshPool", **pool_inputs)
    return with_fresh_seed(with_inputs(prompt, "WanMeshEmptyLatent", width=32, height=32, length=5))


def run_ok(server: ComfyUIServer, prompt: dict) -> None:
    result = server.run(prompt, PROMPT_TIMEOUT_S)
    assert getattr(result, "status", None) == "success", f"{result.error_text()}\n--- log ---\n{server.log()[-4000:]}"


def worker_rss(server: ComfyUIServer) -> int:
    return sum(p.memory_info().rss for p in workers(server))


def workers(server: ComfyUIServer) -> list[psutil.Process]:
    return worker_processes(server.descendants())


def rss_by_rank(processes: list[psutil.Process]) -> list[int]:
    """Each worker's RSS, in rank order (the ``--rank N`` of its command line)."""
    return [p.memory_info().rss for p in worker_processes(processes)]


def fresh_worker_rss() -> list[int]:
    """Each rank's RSS in a freshly started pool of the workflow's layout (its Pool node's devices and world),
    started from this process with the server's code: it has joined its process group and imported its model
    code, and loaded nothing. The figure the workers must come back to after "unload models"."""
    layout = node_of_type(quick_prompt(), "WanMeshPool")["inputs"]
    config = ParallelConfig(devices=layout["devices"], world=layout["world"])
    with WorkerPool(config, timeout_s=PROMPT_TIMEOUT_S) as pool:
        pool.health()
        return rss_by_rank([psutil.Process(pid) for pid in pool.pids()])


def post_free(server: ComfyUIServer, **flags: bool) -> None:
    request = urllib.request.Request(server.base_url + "/free", data=json.dumps(flags).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30.0):
        pass


def free_until(server: ComfyUIServer, done: Callable[[], bool], what: str, **flags: bool) -> None:
    """POST /free with ``flags`` and wait until ``done()``, posting again every REPOST_S seconds.

    ComfyUI's prompt worker reads the flags when it wakes. A /free that arrives while the worker is still busy
    after a prompt (its garbage collection) wakes no one, and the flags then wait for the worker's next wake-up:
    up to 1000 s while the queue stays empty. Posting again wakes it; the flags are a set, so a repeat asks for
    the same thing."""
    deadline = time.monotonic() + EXIT_DEADLINE_S
    while True:
        post_free(server, **flags)
        posted = time.monotonic()
        while time.monotonic() - posted < REPOST_S:
            if done():
                return
            assert time.monotonic() < deadline, f"{what} within {EXIT_DEADLINE_S:.0f} s:\n{server.log()[-3000:]}"
            time.sleep(0.25)


def workers_exit(server: ComfyUIServer, **flags: bool) -> None:
    """POST /free (``free_memory``) and wait until no worker process of the server is left, and no worker
    template (it holds the imported model code)."""
    free_until(server, lambda: not workers(server) and not worker_templates(server),
               "the workers or their template did not exit after free_memory", **flags)


def worker_templates(server: ComfyUIServer) -> list[psutil.Process]:
    found = []
    for proc in server.descendants():
        try:
            if "--template" in proc.cmdline():
                found.append(proc)
        except psutil.Error:
            pass  # ended meanwhile
    return found


@pytest.fixture(scope="module")
def switch_models(comfyui_server: ComfyUIServer, tiny_models_dir: Path) -> Iterator[list[Path]]:
    """Three different model files of about SWITCH_MODEL_MIB MiB in the server's diffusion_models folder
    (ComfyUI lists files added while it runs); removed afterwards, so other servers do not list them."""
    folder = tiny_models_dir / "diffusion_models"
    paths = [write_wide_t2v(folder / f"wan_switch_{seed}.safetensors", seed=seed,
                            ffn_dim=wide_ffn_dim(SWITCH_MODEL_MIB)) for seed in SWITCH_SEEDS]
    try:
        info = comfyui_server.get_json("/object_info/WanMeshModelLoader")["WanMeshModelLoader"]
        listed = info["input"]["required"]["model_name"][0]
        assert all(path.name in listed for path in paths), f"the model loader lists {listed}, not all of {paths}"
        yield paths
    finally:
        for path in paths:
            path.unlink()


def switch_prompt(model_name: str, budget_gb: float) -> dict:
    return with_inputs(quick_prompt(memory_budget_gb=budget_gb), "WanMeshModelLoader", model_name=model_name)


def model_evictions(log: str) -> list[str]:
    """The worker log lines saying the budget unloaded one of the switched model files."""
    return [line for line in log.splitlines() if EVICTION_LOG in line and "unloaded model|" in line
            and "wan_switch_" in line.split("to make room")[0]]


def switch_models_measuring_rss(server: ComfyUIServer, paths: list[Path], budget_gb: float) -> tuple[list[int], str]:
    """Run a prompt per model file in turn; the summed worker RSS after each, and the server log meanwhile."""
    log_start = len(server.log())
    rss = []
    for path in paths:
        run_ok(server, switch_prompt(path.name, budget_gb))
        rss.append(worker_rss(server))
    return rss, server.log()[log_start:]


def switch_report(budget_gb: float, model_bytes: int, rss: list[int], evictions: list[str]) -> str:
    return (f"budget {budget_gb:.3f} GB per rank (0: auto), model files {model_bytes / MIB:.1f} MiB: summed RSS of "
            f"the 2 workers after each prompt {[round(r / MIB) for r in rss]} MiB, growth after the first "
            f"{(max(rss[1:]) - rss[0]) / MIB:+.1f} MiB (if every model stayed resident: "
            f"+{2 * 2 * model_bytes / MIB:.0f} MiB after the third), {len(evictions)} model evictions logged")


# First in the module: its pool (default budget) is the one the next test starts with.
def test_switching_models_without_a_budget_keeps_them_resident(comfyui_server: ComfyUIServer,
                                                               switch_models: list[Path]) -> None:
    """The control for the budget test below: with the default budget (what the machine can hold, far more than
    three models) A, B, C all stay resident and the workers' RSS grows by about two models each, past the bound
    that the budget test must stay under. So that measurement does see resident models."""
    model_bytes = switch_models[0].stat().st_size
    rss, log = switch_models_measuring_rss(comfyui_server, switch_models, 0.0)
    evictions = model_evictions(log)
    report = switch_report(0.0, model_bytes, rss, evictions)
    print(f"\n{report}")
    failure = f"{report}\n--- log tail ---\n{log[-3000:]}"
    assert len(workers(comfyui_server)) == 2, failure
    assert max(rss[1:]) - rss[0] > 2 * model_bytes, f"RSS did not show the resident models: {failure}"
    assert not evictions, f"the default budget unloaded models: {failure}"


def test_free_unloads_models_then_stops_workers(comfyui_server: ComfyUIServer) -> None:
    """UNLOAD_ROUNDS rounds of a prompt and "unload models": the workers stay up (the same processes, no pool
    start: the log says so once per round) and each rank's RSS after each unload comes back within
    UNLOADED_WITHIN_MIB of a freshly started rank's (measured in this run) and of the first unload's (nothing
    accumulates); the next prompt loads the weights again. Then "free memory" stops the workers."""
    fresh = fresh_worker_rss()
    run_ok(comfyui_server, quick_prompt())
    pids = sorted(p.pid for p in workers(comfyui_server))
    assert len(pids) == len(fresh) == 2
    loaded, unloaded = [], []
    for index in range(UNLOAD_ROUNDS):
        loaded.append(rss_by_rank(workers(comfyui_server)))
        unloads = comfyui_server.log().count(UNLOAD_LOG) + 1
        free_until(comfyui_server, lambda: comfyui_server.log().count(UNLOAD_LOG) >= unloads,
                   f"'{UNLOAD_LOG}' did not appear after unload_models", unload_models=True)
        assert sorted(p.pid for p in workers(comfyui_server)) == pids, "unload models restarted the workers"
        unloaded.append(rss_by_rank(workers(comfyui_server)))
        run_ok(comfyui_server, quick_prompt())  # cached loader handles: the same workers load the models again
        assert sorted(p.pid for p in workers(comfyui_server)) == pids, "a prompt after the unload restarted the pool"
    mib = lambda ranks: "/".join(f"{rss / MIB:.0f}" for rss in ranks)  # noqa: E731
    report = (f"worker RSS per rank (MiB): fresh {mib(fresh)}; after the prompt / after the unload, per round: "
              + "; ".join(f"{mib(before)} -> {mib(after)}" for before, after in zip(loaded, unloaded)))
    print(f"\n{report}")
    above_fresh = max(rss - first for round_ in unloaded for rss, first in zip(round_, fresh))
    assert above_fresh <= UNLOADED_WITHIN_MIB * MIB, f"{above_fresh / MIB:.0f} MiB above a fresh worker: {report}"
    assert all(rss - first <= UNLOADED_WITHIN_MIB * MIB for round_ in unloaded for rss, first in zip(round_, unloaded[0])), report

    workers_exit(comfyui_server, free_memory=True)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
    run_ok(comfyui_server, quick_prompt(**BUDGET_POOL))  # a fresh pool
    fresh = sorted(p.pid for p in workers(comfyui_server))
    assert len(fresh) == 2 and not set(fresh) & set(pids)


def test_many_prompts_do_not_grow_worker_memory(comfyui_server: ComfyUIServer) -> None:
    baseline = None
    for index in range(PROMPTS_IN_A_ROW):
        run_ok(comfyui_server, quick_prompt(**BUDGET_POOL))
        if index + 1 == WARM_UP_PROMPTS:
            baseline = worker_rss(comfyui_server)
    final = worker_rss(comfyui_server)
    growth = final / baseline - 1
    print(f"\nworker RSS after {WARM_UP_PROMPTS} prompts {baseline / 2**20:.1f} MiB, after {PROMPTS_IN_A_ROW} "
          f"{final / 2**20:.1f} MiB: {growth:+.2%}")
    assert growth < MAX_GROWTH


def test_switching_models_keeps_worker_memory_within_the_budget(comfyui_server: ComfyUIServer,
                                                                 switch_models: list[Path]) -> None:
    """A, B, C, A, B, C with a budget of 1.5 model files per rank: each load unloads the model before it (logged
    by the workers), so the workers' RSS stays within one model each of its level after the first model."""
    model_bytes = switch_models[0].stat().st_size
    assert model_bytes < SWITCH_BUDGET_GB * 1e9 < 2 * model_bytes, "one model file must fit the budget, two not"
    rss, log = switch_models_measuring_rss(comfyui_server, switch_models * 2, SWITCH_BUDGET_GB)
    evictions = model_evictions(log)
    report = switch_report(SWITCH_BUDGET_GB, model_bytes, rss, evictions)
    print(f"\n{report}")
    failure = f"{report}\n--- log tail ---\n{log[-3000:]}"
    assert len(workers(comfyui_server)) == 2, failure
    assert max(rss[1:]) - rss[0] < 2 * model_bytes, f"worker RSS grew past one model per worker: {failure}"
    assert len(evictions) == 2 * 5, f"not every switch unloaded the model before it, on both ranks: {failure}"
