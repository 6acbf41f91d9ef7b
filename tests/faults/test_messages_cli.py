"""Messages a new user meets: each bad value is named with what is valid, in one line, before any worker starts
(`wanmesh` exits 2); a rank stopped by SIGINT or SIGTERM from outside is one line naming the rank and the signal,
with no traceback (exit 1)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from cli_runs import run_cli
from test_validation_cli import QUICK, sampling_cli
from wanmesh.nodes.pool import WanMeshPool
from wanmesh.parallel.bench.soak import worker_rank
from wanmesh.parallel.driver import local
from wanmesh.parallel.driver.pool import current_pool

TINY_LORA = "loras/wan_tiny_lora_comfy.safetensors"


@pytest.fixture(scope="module")
def models(tiny_models) -> Path:
    return Path(tiny_models["t2v"]).parents[1]


def _assert_refused(result: dict, message: str) -> None:
    lines = result["stderr"].strip().splitlines()
    assert result["code"] == 2, result["stderr"]
    assert len(lines) == 1 and lines[0].startswith("wanmesh: error: ") and message in lines[0], result["stderr"]
    assert not result["pool_started"], "a worker pool was started for input a static check can refuse"


def test_a_lora_strength_that_is_not_a_number_is_named(models, tmp_path):
    lora = models / TINY_LORA  # the file exists: the strength is what is wrong
    result = run_cli(["generate", "--models", str(models), "--prompt", "a fox", "--out", str(tmp_path / "x.mp4"),
                       *QUICK, "--lora", f"{lora}:abc"], tmp_path)
    _assert_refused(result, f"LoRA strength 'abc' in '{lora}:abc' is not a number; valid: FILE or FILE:STRENGTH "
                            "with a number from -100 to 100")


def test_a_negative_kv_window_says_what_is_valid(models, tmp_path):
    result = run_cli(["stream", "--models", str(models), "--prompt", "a fox", "--kv-window", "-1", "--device", "cpu",
                       "--out", str(tmp_path / "x.mp4"), "--chunk-dir", str(tmp_path / "chunks")], tmp_path)
    _assert_refused(result, "kv_window -1 is not valid; valid: a whole number of latent frames >= the chunk (3), "
                            "or none for the whole video")


def test_cpu_ranks_that_disagree_with_world_are_refused_before_any_worker(monkeypatch):
    def no_workers(*args, **kwargs):
        raise AssertionError("a worker pool was started")

    monkeypatch.setattr(local.LocalWorkers, "__init__", no_workers)
    inputs = dict(tp=1, ulysses=1, ring=1, cfg_parallel=False, vae_patch=1, backend="local", ray_address="")
    with pytest.raises(ValueError, match=r"^devices cpu:1 asks for 1 CPU rank but world=2; valid: world=1, or "
                                         r"devices cpu:2 \(or 'cpu', which fits any world\)$"):
        WanMeshPool().make(devices="cpu:1", world=2, **inputs)
    assert current_pool() is None


def _rank_process(cli: subprocess.Popen, rank: int, within_s: float) -> psutil.Process:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for child in psutil.Process(cli.pid).children(recursive=True):
            if worker_rank(child) == rank:
                return child
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} worker appeared within {within_s:g} s")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_rank_stopped_by_a_signal_is_one_line_without_traceback(models, sig, tmp_path):
    cli, seen = sampling_cli(models, tmp_path, "--world", "2")
    _rank_process(cli, 1, 10.0).send_signal(sig)
    text = (seen + cli.communicate(timeout=60)[1]).decode()
    errors = [line for line in text.replace("\r", "\n").splitlines() if line.startswith("wanmesh: error:")]
    assert cli.returncode == 1 and "Traceback" not in text and "[rank1]" not in text, text
    assert errors == [f"wanmesh: error: rank 1: WorkerDied: the worker process was killed by {sig.name} during "
                      "sample; the pool was stopped and the next request starts a fresh one"], text
