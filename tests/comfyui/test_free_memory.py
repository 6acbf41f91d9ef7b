"""ComfyUI's "unload models" / "free memory" (POST /free) on a real server reach the WanMesh pool, and many
prompts in a row do not grow the workers' memory.

unload_models: the pool's models are unloaded (logged), the workers keep running, and the next prompt loads
what it needs again. free_memory: the worker processes exit; the next prompt starts a fresh pool.
"""

from __future__ import annotations

import json
import time
import urllib.request

import psutil
from comfyui_server import ComfyUIServer
from workflow_graph import load_workflow, with_fresh_seed, with_inputs

PROMPT_TIMEOUT_S = 300.0
EXIT_DEADLINE_S = 60.0
PROMPTS_IN_A_ROW = 50
WARM_UP_PROMPTS = 10  # allocator and caches settle before the baseline is taken
MAX_GROWTH = 0.05


def quick_prompt() -> dict:
    prompt = with_inputs(load_workflow("api/t2v.json"), "WanMeshSampler", steps=1)
    return with_fresh_seed(with_inputs(prompt, "WanMeshEmptyLatent", width=32, height=32, length=5))


def run_ok(server: ComfyUIServer, prompt: dict) -> None:
    result = server.run(prompt, PROMPT_TIMEOUT_S)
    assert getattr(result, "status", None) == "success", f"{result.error_text()}\n--- log ---\n{server.log()[-4000:]}"


def workers(server: ComfyUIServer) -> list[psutil.Process]:
    found = []
    for proc in server.descendants():
        try:
            if "--rank" in proc.cmdline():
                found.append(proc)
        except psutil.NoSuchProcess:
            pass
    return found


def post_free(server: ComfyUIServer, **flags: bool) -> None:
    request = urllib.request.Request(server.base_url + "/free", data=json.dumps(flags).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30.0):
        pass


def wait_for_log(server: ComfyUIServer, text: str, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while server.log().count(text) < count:
        assert time.monotonic() < deadline, f"'{text}' did not appear {count} times in the log:\n{server.log()[-3000:]}"
        time.sleep(0.25)


def test_free_unloads_models_then_stops_workers(comfyui_server: ComfyUIServer) -> None:
    run_ok(comfyui_server, quick_prompt())
    pids = sorted(p.pid for p in workers(comfyui_server))
    assert len(pids) == 2

    post_free(comfyui_server, unload_models=True)
    wait_for_log(comfyui_server, "unloaded the worker pool's models", 1, EXIT_DEADLINE_S)
    assert sorted(p.pid for p in workers(comfyui_server)) == pids  # the workers keep running
    run_ok(comfyui_server, quick_prompt())  # cached loader handles: the workers load the models again

    started = time.monotonic()
    post_free(comfyui_server, free_memory=True)
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids):
        assert time.monotonic() - started < EXIT_DEADLINE_S, "the workers did not exit after free_memory"
        time.sleep(0.25)
    assert workers(comfyui_server) == []
    run_ok(comfyui_server, quick_prompt())  # a fresh pool
    fresh = sorted(p.pid for p in workers(comfyui_server))
    assert len(fresh) == 2 and not set(fresh) & set(pids)


def test_many_prompts_do_not_grow_worker_memory(comfyui_server: ComfyUIServer) -> None:
    baseline = None
    for index in range(PROMPTS_IN_A_ROW):
        run_ok(comfyui_server, quick_prompt())
        if index + 1 == WARM_UP_PROMPTS:
            baseline = sum(p.memory_info().rss for p in workers(comfyui_server))
    final = sum(p.memory_info().rss for p in workers(comfyui_server))
    growth = final / baseline - 1
    print(f"\nworker RSS after {WARM_UP_PROMPTS} prompts {baseline / 2**20:.1f} MiB, after {PROMPTS_IN_A_ROW} "
          f"{final / 2**20:.1f} MiB: {growth:+.2%}")
    assert growth < MAX_GROWTH
