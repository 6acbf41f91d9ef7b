"""Stopping the driver during a request: SIGINT, SIGTERM or SIGKILL of a driver process whose pool is busy
in a step loop (collectives and progress every step, as in sampling) leaves, within seconds, no worker
process, no ``wanmesh-pool-*`` temp folder and no shared-memory segment. The driver runs the call in a daemon
thread, as ComfyUI does, so SIGINT exercises the exit handler while a call holds the pool's lock.

Also: the sweep at pool start removes temp folders whose owner process is dead, and only those.
Time limits here are deadlines for the failure, not performance assertions.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pool_helpers import traceback_deadline, wait_gone
from wanmesh.parallel.driver import local

PACK_DIR = Path(__file__).resolve().parents[2]
STEPS_DIAGNOSTICS = str(PACK_DIR / "tests" / "distributed" / "pool_diagnostics.py")
DRIVER_EXITS_WITHIN_S = 15.0
CLEAN_WITHIN_S = 15.0
TEST_DEADLINE_S = 300

DRIVER = """
import sys, threading, time, types
pack = types.ModuleType("host_custom_folder"); pack.__path__ = [{pack_dir!r}]; sys.modules["host_custom_folder"] = pack
from host_custom_folder.parallel.config import ParallelConfig
from host_custom_folder.parallel.driver.pool import get_pool
from host_custom_folder.parallel.protocol import Diagnostic
import torch
pool = get_pool(ParallelConfig(world=2, devices="cpu", worker_timeout=30), diagnostics={diagnostics!r})
pool.call(Diagnostic("echo", tensors=[torch.ones(1000)]))  # both sides now own shared-memory segments
print(" ".join(map(str, pool.pids())), flush=True)

def sample_forever():
    pool.call(Diagnostic("steps", {{"steps": 10**6, "step_s": 0.01}}),
              progress=lambda step, total: step == 3 and print("sampling", flush=True))

threading.Thread(target=sample_forever, daemon=True).start()  # ComfyUI runs prompts in a daemon thread
time.sleep(600)
"""


@pytest.fixture(autouse=True)
def deadline():
    with traceback_deadline(TEST_DEADLINE_S):
        yield


def _leftovers(tmp: Path, driver_pid: int) -> list[str]:
    folders = [str(p) for p in tmp.glob("wanmesh-pool-*")]
    segments = [n for n in os.listdir("/dev/shm") if n.startswith(f"wanmesh_{driver_pid}_")]
    return folders + segments


def _wait_clean(tmp: Path, driver_pid: int, within_s: float) -> list[str]:
    deadline = time.monotonic() + within_s
    while _leftovers(tmp, driver_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _leftovers(tmp, driver_pid)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signalled_driver_leaves_no_worker_folder_or_segment(sig, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(pack_dir=str(PACK_DIR), diagnostics=STEPS_DIAGNOSTICS))
    pool_tmp = tmp_path / "tmp"
    pool_tmp.mkdir()
    env = {**os.environ, "WANMESH_WORKER_THREADS": "1", "OMP_NUM_THREADS": "1", "TMPDIR": str(pool_tmp)}
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
    workers: list[int] = []
    try:
        workers = [int(p) for p in driver.stdout.readline().split()]
        assert len(workers) == 2, driver.stderr.read() if driver.poll() is not None else "no worker pids"
        assert driver.stdout.readline().strip() == "sampling"
        assert _leftovers(pool_tmp, driver.pid), "the running pool must own a temp folder and segments"
        sent = time.monotonic()
        driver.send_signal(sig)
        driver.wait(timeout=DRIVER_EXITS_WITHIN_S)
        exited = time.monotonic() - sent
        survivors = wait_gone(workers, CLEAN_WITHIN_S)
        left = _wait_clean(pool_tmp, driver.pid, CLEAN_WITHIN_S)
        clean = time.monotonic() - sent
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        wait_gone(workers, 0)
        driver.stdout.close()
        driver.stderr.close()
    print(f"{sig.name}: driver exited after {exited:.1f} s, workers and files gone after {clean:.1f} s")
    assert not survivors, f"workers {survivors} outlived a driver stopped by {sig.name}"
    assert not left, f"a driver stopped by {sig.name} left {left}"


def test_the_sweep_removes_only_folders_whose_owner_is_dead(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folders = {}
    for name, owner in (("dead", dead.pid), ("alive", os.getpid()), ("unowned", None)):
        folder = tmp_path / f"{local.POOL_DIR_PREFIX}{name}"
        folder.mkdir()
        (folder / "store").write_text("x")
        if owner is not None:
            (folder / local.OWNER_FILE).write_text(str(owner))
        folders[name] = folder
    other = tmp_path / "someone-elses-folder"
    other.mkdir()
    (other / local.OWNER_FILE).write_text(str(dead.pid))
    removed = local.sweep_stale_pool_files()
    assert str(folders["dead"]) in removed and not folders["dead"].exists()
    assert folders["alive"].exists() and folders["unowned"].exists() and other.exists()
