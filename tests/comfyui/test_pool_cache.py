"""A pool that a cached node output outlives is never handed to a node as usable (ComfyUI 0.33 with its LRU
cache, which keeps the outputs of earlier prompts: the Pool node's runner and the loaders' model handles).

A Pool node that fails (backend ray at an address where nothing answers) is one clear error naming the address,
and leaves the running pool as it was: the good prompt after it runs on the same workers. A pool closed because
another Pool node config replaced it is started again with its own settings when a cached node uses it, and the
models its handles name are loaded again.
"""

from __future__ import annotations

import socket

from comfyui_server import ComfyUIServer
from test_free_memory import quick_prompt, run_ok, workers

PROMPT_TIMEOUT_S = 300.0


def _closed_port() -> int:
    """A local port where nothing listens (connections are refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_pids(server: ComfyUIServer) -> list[int]:
    return sorted(proc.pid for proc in workers(server))


def test_a_failing_pool_node_leaves_the_running_pool_usable(lru_comfyui_server: ComfyUIServer) -> None:
    server = lru_comfyui_server
    run_ok(server, quick_prompt())
    pids = _worker_pids(server)
    assert len(pids) == 2

    address = f"127.0.0.1:{_closed_port()}"
    failed = server.run(quick_prompt(backend="ray", devices="cpu", ray_address=address), PROMPT_TIMEOUT_S)
    error = failed.error_text()
    assert failed.status == "error" and "WanMeshPool" in error, error
    assert f"the Ray cluster at '{address}' cannot be reached" in error, error
    assert _worker_pids(server) == pids, "the failing Pool node stopped the running pool"

    run_ok(server, quick_prompt())  # the cached Pool node output: the same pool, the same workers
    assert _worker_pids(server) == pids


def test_a_cached_pool_that_was_replaced_is_started_again(lru_comfyui_server: ComfyUIServer) -> None:
    server = lru_comfyui_server
    run_ok(server, quick_prompt())
    first = _worker_pids(server)
    run_ok(server, quick_prompt(devices="cpu:1", world=1))  # another config: the first pool is closed
    assert len(_worker_pids(server)) == 1

    run_ok(server, quick_prompt())  # every node but the sampler cached, its runner's pool closed
    again = _worker_pids(server)
    assert len(again) == 2 and not set(again) & set(first)
