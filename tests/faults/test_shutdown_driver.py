"""Stopping the driver: SIGINT of a driver process whose pool is busy in a step loop (collectives and progress
every step, as in sampling) leaves, within seconds, no worker process, no ``wanmesh-pool-*`` temp folder and no
shared-memory segment. The driver runs the call in a daemon thread, as ComfyUI does, so SIGINT exercises the
exit handler while a call holds the pool's lock.

SIGKILL and SIGTERM, where the driver cleans up nothing, at moments drawn with a fixed seed across a tiny
model's whole life in a pool - starting, loading weights, sampling, streaming chunks, idle - and of the
`wanmesh stream` command shortly after its start: within CLEAN_WITHIN_S no worker, segment or temp folder is
left (the workers remove them).

Also: the sweep at pool start removes temp folders whose owner process is dead, and only those.
Time limits here are deadlines for the failure, not performance assertions.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from pool_helpers import traceback_deadline, wait_gone
from wanmesh.parallel.driver import local

PACK_DIR = Path(__file__).resolve().parents[2]
LAUNCHER = Path(__file__).with_name("cli_launcher.py")
STEPS_DIAGNOSTICS = str(PACK_DIR / "tests" / "distributed" / "pool_diagnostics.py")
DRIVER_EXITS_WITHIN_S = 15.0
CLEAN_WITHIN_S = 15.0
KILLED_CLEAN_WITHIN_S = 10.0
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


# A pool's life in phases, each announced on stdout as "phase NAME" as it begins; the call runs in a daemon thread.
PHASED_DRIVER = """
import sys, threading, time, types
pack = types.ModuleType("host_custom_folder"); pack.__path__ = [{pack_dir!r}]; sys.modules["host_custom_folder"] = pack
from host_custom_folder.parallel.config import ParallelConfig, latent_shape
from host_custom_folder.parallel.driver.runner import PoolRunner
from host_custom_folder.parallel.protocol import SampleRequest, StreamSample
import torch

def phase(name):
    print("phase", name, flush=True)

def life():
    phase("start")
    runner = PoolRunner.for_config(ParallelConfig(world=2, devices="cpu", worker_timeout=30))
    phase("load")
    model, vae = runner.load_model({model!r}), runner.load_vae({vae!r})
    text = runner.encode_text(runner.load_text_encoder({text_encoder!r}), ["a fox"])
    phase("sample")
    runner.sample(SampleRequest(model, torch.zeros(latent_shape(64, 64, 9)), text, text, seed=0, steps=6,
                                guidance_scale=1.0, shift=3.0, sampler="euler"))
    phase("stream")
    runner.stream(StreamSample(model, torch.zeros(latent_shape(64, 64, 17)), text, [], seed=0, steps=2, chunk=1,
                               vae_handle=vae))
    phase("idle")

threading.Thread(target=life, daemon=True).start()
time.sleep(600)
"""
# (phase, longest delay after its announcement): each phase three kills, both signals; the delays come from KILL_SEED.
KILL_PHASES = (("start", 2.5), ("load", 0.8), ("sample", 1.2), ("stream", 2.0), ("idle", 0.3))
KILL_SEED = 20240611
KILL_SIGNALS = (signal.SIGKILL, signal.SIGTERM)


def _kill_plan() -> list[tuple[str, float, signal.Signals]]:
    rng = random.Random(KILL_SEED)
    return [(phase, round(rng.uniform(0.0, longest), 2), KILL_SIGNALS[i % 2])
            for i, (phase, longest) in enumerate(KILL_PHASES * 3)]


KILL_PLAN = _kill_plan()
CLI_KILLS = ((1.0, signal.SIGKILL), (3.5, signal.SIGKILL), (5.0, signal.SIGTERM))  # seconds after launch


@pytest.fixture(autouse=True)
def deadline():
    with traceback_deadline(TEST_DEADLINE_S):
        yield


def _leftovers(tmp: Path, driver_pid: int, workers: bool = False) -> list[str]:
    """The pool temp folders under ``tmp`` and the driver's segments; with ``workers`` also the live processes
    whose command line names ``tmp`` (a worker's settings hold its pool folder's path)."""
    folders = [str(p) for p in tmp.glob("wanmesh-pool-*")]
    segments = [n for n in os.listdir("/dev/shm") if n.startswith(f"wanmesh_{driver_pid}_")]
    return folders + segments + ([f"worker pid {pid}" for pid in _processes_naming(tmp)] if workers else [])


def _processes_naming(tmp: Path) -> list[int]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(tmp) in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc.pid)
    return found


def _wait_clean(tmp: Path, driver_pid: int, within_s: float, workers: bool = False) -> list[str]:
    deadline = time.monotonic() + within_s
    while _leftovers(tmp, driver_pid, workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _leftovers(tmp, driver_pid, workers)


def _pool_env(pool_tmp: Path) -> dict[str, str]:
    return {**os.environ, "WANMESH_WORKER_THREADS": "1", "OMP_NUM_THREADS": "1", "TMPDIR": str(pool_tmp)}


def _wait_for_line(driver: subprocess.Popen, wanted: str) -> None:
    for line in driver.stdout:
        if line.strip() == wanted:
            return
    raise AssertionError(f"the driver ended (exit {driver.wait()}) before printing {wanted!r}: {driver.stderr.read()}")


def _kill_and_check(driver: subprocess.Popen, sig: signal.Signals, pool_tmp: Path, what: str) -> None:
    """Signal the driver, then within KILLED_CLEAN_WITHIN_S no worker, segment or pool folder may be left."""
    sent = time.monotonic()
    driver.send_signal(sig)
    try:
        driver.wait(timeout=DRIVER_EXITS_WITHIN_S)
        left = _wait_clean(pool_tmp, driver.pid, KILLED_CLEAN_WITHIN_S, workers=True)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for pid in _processes_naming(pool_tmp):
            psutil.Process(pid).kill()
    print(f"{what}: clean after {time.monotonic() - sent:.1f} s")
    assert not left, f"{what} left {left}"


def _threads_taking(pid: int, signals: set[int]) -> list[str]:
    """The threads of process ``pid`` that do not block all of ``signals`` (from /proc: SigBlk, a hex mask)."""
    taking = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        blocked = int(fields["SigBlk"], 16)
        if any(not blocked & (1 << (sig - 1)) for sig in signals):
            taking.append(f"{task.name} ({fields['Name'].strip()})")
    return taking


# SIGTERM and SIGKILL: test_a_killed_driver_leaves_nothing_whatever_it_was_doing.
@pytest.mark.parametrize("sig", [signal.SIGINT], ids=lambda s: s.name)
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
        for pid in workers:  # else the parent-death signal may land on a thread that dies by it, cleaning nothing
            taking = _threads_taking(pid, {signal.SIGTERM, signal.SIGINT})
            assert len(taking) == 1, f"worker {pid}: threads {taking} take SIGTERM/SIGINT; only its sigwait thread may"
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


@pytest.fixture(scope="module")
def phased_driver(tiny_models, tmp_path_factory) -> Path:
    script = tmp_path_factory.mktemp("phased") / "driver.py"
    script.write_text(PHASED_DRIVER.format(pack_dir=str(PACK_DIR), model=str(tiny_models["t2v"]),
                                           vae=str(tiny_models["vae"]), text_encoder=str(tiny_models["text_encoder"])))
    return script


@pytest.mark.parametrize("phase, delay_s, sig", KILL_PLAN,
                         ids=[f"{phase}+{delay:.2f}s-{sig.name}" for phase, delay, sig in KILL_PLAN])
def test_a_killed_driver_leaves_nothing_whatever_it_was_doing(phased_driver, phase, delay_s, sig, tmp_path):
    pool_tmp = tmp_path / "tmp"
    pool_tmp.mkdir()
    driver = subprocess.Popen([sys.executable, str(phased_driver)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_pool_env(pool_tmp))
    try:
        _wait_for_line(driver, f"phase {phase}")
        time.sleep(delay_s)
    except BaseException:
        driver.kill()
        raise
    _kill_and_check(driver, sig, pool_tmp, f"{sig.name} {delay_s:.2f} s into {phase}")
    driver.stdout.close()
    driver.stderr.close()


@pytest.mark.parametrize("delay_s, sig", CLI_KILLS, ids=[f"{delay}s-{sig.name}" for delay, sig in CLI_KILLS])
def test_a_killed_stream_command_leaves_nothing(tiny_models, delay_s, sig, tmp_path):
    pool_tmp = tmp_path / "tmp"
    pool_tmp.mkdir()
    models = Path(tiny_models["t2v"]).parents[1]
    driver = subprocess.Popen([sys.executable, str(LAUNCHER), "stream", "--models", str(models), "--prompt", "a fox",
                               "--world", "2", "--device", "cpu", "--out", str(tmp_path / "fox.mp4"),
                               "--chunk-dir", str(tmp_path / "chunks")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_pool_env(pool_tmp))
    time.sleep(delay_s)
    _kill_and_check(driver, sig, pool_tmp, f"wanmesh stream: {sig.name} {delay_s:.2f} s after launch")


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
