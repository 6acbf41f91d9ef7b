"""Load held: two clients queue 40 prompts of mixed workflows on one real ComfyUI server (the 2024 copy).

T2V, LoRA, VACE (two references), streaming and two-expert prompts, each with its own seed, from two client
threads at once: a first round of 10 on one pool, a ``/free`` with ``unload_models`` (the workers exit) and a Pool
setting change (Ulysses 2 -> tensor parallel 2), then three rounds of 10 on the new pool. Every prompt must succeed
and every file it lists must be complete (images readable, each MP4 decodable); the new workers' summed resident
memory after the last round exceeds its highest level after the rounds before by at most 5% (the same processes
and the same workflows each round: a leak adds its share every round; the workers return the heap a request
freed after each one, so rounds of the same prompts measured 705, 706, 706 MiB; counted without the
memory-mapped model files' pages, which the page cache holds and drops at will);
after ``/free`` with ``free_memory`` no worker process and no new pool temp folder is left. Steps are cut to 2 so
the 40 prompts stay within a few minutes on two CPU cores.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from comfyui_server import ComfyUIServer, PromptResult
from PIL import Image
from test_free_memory import post_free, workers, workers_exit
from workflow_graph import MAX_SEED, load_workflow

from wanmesh.parallel import read_video
from wanmesh.parallel.driver.local import OWNER_FILE, POOL_DIR_PREFIX


@pytest.fixture(scope="module")
def comfyui_server(own_comfyui_server: ComfyUIServer) -> ComfyUIServer:
    """This module's own server: it measures the workers' memory and pools from a server that ran nothing else."""
    return own_comfyui_server


WORKFLOWS = ("t2v", "t2v_lora", "vace_r2v", "stream_t2v", "wan22_two_experts")
PROMPTS_PER_CLIENT_AND_ROUND = 5  # two clients, four rounds: 40 prompts
FIRST_POOL = dict(devices="cpu:2", world=2, tp=1, ulysses=2, ring=1, cfg_parallel=False, vae_patch=1)
SECOND_POOL = dict(FIRST_POOL, tp=2, ulysses=1)  # the setting changed in the middle: new workers
PROMPT_TIMEOUT_S = 600.0
MEMORY_GROWTH = 0.05  # rounds of the same prompts: 705, 706, 706 MiB (before the workers trimmed: up to 14% apart)
EXIT_DEADLINE_S = 60.0
SAMPLER_TYPES = ("WanMeshSampler", "WanMeshStreamSampler")


def prepared(name: str, pool: dict[str, Any], seed: int) -> dict[str, Any]:
    """An example workflow's API prompt on ``pool`` with ``seed``; samplers cut to 2 steps (the two-expert chain
    keeps its own step split)."""
    prompt = load_workflow(f"api/{name}.json")
    for node in prompt.values():
        inputs = node["inputs"]
        if node["class_type"] == "WanMeshPool":
            inputs.update(pool)
        if node["class_type"] in SAMPLER_TYPES:
            inputs["seed"] = seed
            if name != "wan22_two_experts":
                inputs["steps"] = 2
    return prompt


def queue_round(server: ComfyUIServer, pool: dict[str, Any], rng: random.Random,
                count: int = PROMPTS_PER_CLIENT_AND_ROUND) -> list[tuple[str, str]]:
    """Two client threads submit ``count`` prompts each; (workflow, prompt id) of all."""
    plans = [[(WORKFLOWS[(client + i) % len(WORKFLOWS)], rng.randint(0, MAX_SEED))
              for i in range(count)] for client in range(2)]
    submitted: list[tuple[str, str]] = []
    lock = threading.Lock()

    def client(plan: list[tuple[str, int]]) -> None:
        client_id = f"load-client-{threading.get_ident()}"
        for name, seed in plan:
            prompt_id = server.submit(prepared(name, pool, seed), client_id=client_id)
            assert isinstance(prompt_id, str), f"{name} rejected: {prompt_id.error_text()}"
            with lock:
                submitted.append((name, prompt_id))

    threads = [threading.Thread(target=client, args=(plan,)) for plan in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120.0)
    assert len(submitted) == 2 * count, f"only {len(submitted)} of {2 * count} prompts were queued"
    return submitted


def assert_outputs_complete(server: ComfyUIServer, name: str, result: PromptResult) -> None:
    assert result.status == "success", f"{name} failed:\n{result.error_text()}"
    files = [item for output in result.outputs.values() for items in output.values() if isinstance(items, list)
             for item in items if isinstance(item, dict) and "filename" in item]
    assert files, f"{name} listed no output file"
    for item in files:
        path = server.output_dir / item["subfolder"] / item["filename"]
        assert path.is_file() and path.stat().st_size > 0, f"{name}: {path} is missing or empty"
        if path.suffix == ".mp4":
            assert len(read_video(path)) > 0, f"{name}: {path.name} holds no frame"
        elif path.suffix == ".png":
            with Image.open(path) as image:
                image.verify()


def finish_round(server: ComfyUIServer, submitted: list[tuple[str, str]]) -> None:
    for name, prompt_id in submitted:
        assert_outputs_complete(server, name, server.wait_for(prompt_id, PROMPT_TIMEOUT_S))


def worker_anonymous_rss(server: ComfyUIServer) -> int:
    """The workers' summed resident memory that is their own (RSS less file-backed and shared pages): where a leak
    shows. The model files are memory-mapped, so their pages count in RSS as the rounds touch more of them, and
    the page cache may drop them again; neither is memory the workers hold on to."""
    return sum(info.rss - info.shared for info in (process.memory_info() for process in workers(server)))


def pool_folders(server: ComfyUIServer) -> set[Path]:
    """The pool temp folders this server's pools made (their owner file names the server's process): the other
    test processes' servers and pools, running meanwhile, make their own."""
    folders = set()
    for folder in Path(tempfile.gettempdir()).glob(f"{POOL_DIR_PREFIX}*"):
        try:
            owner = int((folder / OWNER_FILE).read_text().strip())
        except (OSError, ValueError):
            continue  # being made or removed
        if owner == server.pid:
            folders.add(folder)
    return folders


def test_two_clients_forty_mixed_prompts_with_free_and_a_pool_change(comfyui_server: ComfyUIServer) -> None:
    folders_before = pool_folders(comfyui_server)
    rng = random.Random(2026)
    finish_round(comfyui_server, queue_round(comfyui_server, FIRST_POOL, rng))
    first_pool_rss = worker_anonymous_rss(comfyui_server)
    assert pool_folders(comfyui_server) - folders_before, "the running pool's temp folder is not found as the server's"

    post_free(comfyui_server, unload_models=True)
    finish_round(comfyui_server, queue_round(comfyui_server, SECOND_POOL, rng))
    after_warm_up = worker_anonymous_rss(comfyui_server)
    pids = sorted(p.pid for p in workers(comfyui_server))
    finish_round(comfyui_server, queue_round(comfyui_server, SECOND_POOL, rng))
    after_second_round = worker_anonymous_rss(comfyui_server)
    finish_round(comfyui_server, queue_round(comfyui_server, SECOND_POOL, rng))
    after_run = worker_anonymous_rss(comfyui_server)
    assert sorted(p.pid for p in workers(comfyui_server)) == pids, "the workers changed within one pool's rounds"
    earlier_peak = max(after_warm_up, after_second_round)
    growth = (after_run - earlier_peak) / earlier_peak
    report = (f"workers' summed anonymous RSS: first pool {first_pool_rss / 2**20:.0f} MiB after 10 prompts; new pool "
              f"{after_warm_up / 2**20:.0f} MiB after its first 10, {after_second_round / 2**20:.0f} MiB after 20, "
              f"{after_run / 2**20:.0f} MiB after 30 ({growth:+.1%} over the earlier peak)")
    print("\n" + report)
    assert growth <= MEMORY_GROWTH, report  # less memory after the run is memory returned, not held

    workers_exit(comfyui_server, unload_models=True, free_memory=True)
    deadline = time.monotonic() + EXIT_DEADLINE_S
    while pool_folders(comfyui_server) - folders_before and time.monotonic() < deadline:
        time.sleep(0.25)
    left = pool_folders(comfyui_server) - folders_before
    assert not left, f"pool temp folders left behind: {left}"
