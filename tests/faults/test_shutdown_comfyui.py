"""SIGINT (Ctrl-C), SIGTERM or SIGKILL to a real ComfyUI server (0.33) while a WanMesh prompt is sampling:
the server exits within seconds (its exit handler must not wait on the running sample call) with its normal exit
code, no abort ('terminate called without an active exception', 'Fatal Python error') and no traceback in its log,
a node error, if one is printed (ComfyUI prints its traceback), saying the pool was stopped because the server is shutting down; and within
LEFT_NOTHING_WITHIN_S no worker process, pool temp folder or shared-memory segment is left (after SIGKILL the
workers notice their parent is gone and clean up themselves). Uses the prepared ComfyUI copy and tiny models of
tests/comfyui.

Time limits here are deadlines for the failure, not performance assertions.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
EXITS_WITHIN_S = 20.0
LEFT_NOTHING_WITHIN_S = 10.0
TEST_DEADLINE_S = 900
# ComfyUI's own exit after each signal: SIGINT ends its loop with KeyboardInterrupt (0 on 0.33; 130 or -2 when
# Python re-raises the signal), SIGTERM is its default action (-15) or a handled exit (0).
NORMAL_EXITS = {signal.SIGINT: (0, 130, -signal.SIGINT), signal.SIGTERM: (0, 143, -signal.SIGTERM)}
ABORT_SIGNS = ("terminate called without an active exception", "Fatal Python error", "killed by SIGKILL")
LONG_RUN_STEPS = 1000  # the node's maximum; the interrupt comes after the first step


def _comfyui_fixtures():
    """The helpers of tests/comfyui/conftest.py (server class, preparation, tiny models), loaded by path."""
    spec = importlib.util.spec_from_file_location("wanmesh_comfyui_fixtures", REPO_ROOT / "tests/comfyui/conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    _comfyui_fixtures()._run_quietly([os.sys.executable, "-c", "import sys; from wanmesh.parallel.cli import main; "
                                      "sys.exit(main(sys.argv[1:]))", "make-tiny", str(folder)],
                                     "wanmesh make-tiny", timeout_s=300)
    return folder


def _left_behind(pool_tmp: Path, pid: int) -> list:
    return list(pool_tmp.glob("wanmesh-pool-*")) + [n for n in os.listdir("/dev/shm") if n.startswith(f"wanmesh_{pid}_")]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signal_to_comfyui_during_sampling_exits_and_leaves_no_worker(sig, models, tmp_path):
    faulthandler.dump_traceback_later(TEST_DEADLINE_S, exit=True)
    fx = _comfyui_fixtures()
    comfy_dir = fx._prepared_comfyui("recent")
    pool_tmp = tmp_path / "tmp"
    pool_tmp.mkdir()
    work = tmp_path / "comfyui"
    work.mkdir()
    config = fx.write_model_paths_config(models, work / "extra_model_paths.yaml")
    server = fx.RecentComfyUIServer(comfy_dir, work, config,
                                    extra_env={"OMP_NUM_THREADS": "1", "WANMESH_WORKER_THREADS": "1",
                                               "TMPDIR": str(pool_tmp)})
    fx.copy_workflow_inputs(server.input_dir)
    prompt = fx.with_fresh_seed(fx.load_workflow("api/t2v.json"))
    sampler = next(node for node in prompt.values() if node["class_type"] == "WanMeshSampler")
    sampler["inputs"]["steps"] = LONG_RUN_STEPS
    try:
        server.start(fx.SERVER_START_TIMEOUT_S)
        process = server._process
        with server.listen() as listener:
            prompt_id = server.submit(prompt, client_id=listener.client_id)
            assert isinstance(prompt_id, str), f"prompt rejected: {prompt_id.error_text()}"
            listener.wait_for(lambda e: e.kind == "progress" and e.data.get("prompt_id", prompt_id) == prompt_id,
                              600.0, "a progress event from the sampler")
        workers = server.descendants()
        assert workers, "the prompt runs on worker processes"
        sent = time.monotonic()
        process.send_signal(sig)
        process.wait(timeout=EXITS_WITHIN_S)
        exited = time.monotonic() - sent
        _, alive = psutil.wait_procs(workers, timeout=LEFT_NOTHING_WITHIN_S)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        deadline = time.monotonic() + LEFT_NOTHING_WITHIN_S
        while _left_behind(pool_tmp, process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _left_behind(pool_tmp, process.pid)
    finally:
        left_behind = server.stop(grace_s=5.0)
        faulthandler.cancel_dump_traceback_later()
    log = server.log()
    print(f"ComfyUI exited {exited:.1f} s after {sig.name} with {process.returncode}")
    if sig != signal.SIGKILL:  # an orderly exit: no abort while the interpreter ends, and no made-up cause
        assert process.returncode in NORMAL_EXITS[sig], f"exit {process.returncode} after {sig.name}:\n{log[-4000:]}"
        for sign in ABORT_SIGNS:
            assert sign not in log, f"{sign!r} after {sig.name}:\n{log[-4000:]}"
        stop_lines = [line for line in log.splitlines() if "WanMeshWorkerError" in line or "WanMesh Sampler failed" in line]
        assert all("shutting down" in line for line in stop_lines), "\n".join(stop_lines)
    assert not alive, f"workers outlived ComfyUI: {[p.pid for p in alive]}"
    assert not left, f"ComfyUI's pool left {left}"
    assert not left_behind, left_behind
