"""The command line as a user meets it (fresh interpreters): parsing and the quick checks load no torch; the plan
line, phases and progress lines; `--model` alone composes the VAE and text encoder of its kind; every offered
sampler x scheduler runs where scipy cannot be imported (the beta schedule computed without it, equal to scipy's);
zip pickles holding code are refused before any worker with no `weights_only=False` advice; outputs get the
user's umask; a too-small disk is found before sampling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import run_cli

QUICK = ["--width", "32", "--height", "32", "--frames", "5", "--steps", "2", "--device", "cpu"]
BLOCK_SCIPY = '''import sys
from importlib.machinery import PathFinder


class _WithoutScipy(PathFinder):  # as if scipy were not installed: not found, not importable
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "scipy" or name.startswith("scipy."):
            return None
        return PathFinder.find_spec(name, path, target)


sys.meta_path[:] = [_WithoutScipy if finder is PathFinder else finder for finder in sys.meta_path]
'''


@pytest.fixture(scope="module")
def no_scipy(tmp_path_factory) -> dict[str, str]:
    """Environment whose interpreters (the CLI and its spawned workers) cannot import scipy."""
    shim = tmp_path_factory.mktemp("no_scipy")
    (shim / "sitecustomize.py").write_text(BLOCK_SCIPY)
    path = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "WANMESH_WORKER_THREADS": "1"}


def test_parsing_and_quick_refusals_import_no_torch():
    code = ("import sys; from wanmesh.parallel.cli import build_parser, main; build_parser(False); "
            "status = main(['generate', '--prompt', 'x', '--out', 'x.mp4', '--width', '100']); "
            "print(status, sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "2 []", result.stdout + result.stderr
    assert "width 100 is not a positive multiple of 8" in result.stderr


def test_beta_schedule_without_scipy_equals_scipys(monkeypatch):
    pytest.importorskip("scipy")
    from wanmesh.parallel.sampling.schedules import schedule

    cases = [(steps, 5.0) for steps in (*range(1, 31), 57, 100)] + [(12, 1.0), (12, 8.0)]
    with_scipy = {case: schedule("beta", *case) for case in cases}
    monkeypatch.setitem(sys.modules, "scipy", None)  # import scipy now raises ImportError
    monkeypatch.setitem(sys.modules, "scipy.stats", None)
    for case in cases:
        assert schedule("beta", *case).tolist() == with_scipy[case].tolist(), case


ALL_PAIRS = '''
import json, sys, torch
from wanmesh.parallel import COMFY_SAMPLERS, SAMPLERS, SCHEDULERS, ParallelConfig, PoolRunner, SampleRequest
from wanmesh.parallel.driver.pool import WorkerPool
model, text_encoder = sys.argv[1], sys.argv[2]
import importlib.util
assert importlib.util.find_spec("scipy") is None
with WorkerPool(ParallelConfig(world=1, devices="cpu")) as pool:
    runner = PoolRunner(pool)
    text = runner.load_text_encoder(text_encoder)
    prompt = runner.encode_text(text, ["a fox"])
    handle = runner.load_model(model)
    done = []
    for sampler in SAMPLERS:
        for scheduler in SCHEDULERS:
            reply = runner.sample_reply(SampleRequest(handle=handle, latent=torch.zeros(1, 16, 2, 4, 4),
                positive=prompt, negative=prompt, seed=1, steps=2, guidance_scale=2.0, shift=3.0,
                sampler=sampler, scheduler=scheduler))
            assert torch.isfinite(reply.latents).all(), (sampler, scheduler)
            done.append([sampler, scheduler])
print(json.dumps(done))
'''


def test_every_sampler_and_scheduler_runs_without_scipy(tiny_models, no_scipy, tmp_path):
    """One pool, every offered pair, 2 steps on the tiny model, in an install where scipy cannot be imported."""
    from wanmesh.parallel.config import SAMPLERS, SCHEDULERS

    script = tmp_path / "all_pairs.py"
    script.write_text(ALL_PAIRS)
    result = subprocess.run([sys.executable, str(script), str(tiny_models["t2v"]), str(tiny_models["text_encoder"])],
                            capture_output=True, text=True, timeout=400, env={**os.environ, **no_scipy})
    assert result.returncode == 0, result.stderr[-3000:]
    done = json.loads(result.stdout.strip().splitlines()[-1])
    assert sorted(map(tuple, done)) == sorted((s, k) for s in SAMPLERS for k in SCHEDULERS)


def test_model_alone_beta_without_scipy_progress_and_umask(tiny_models, no_scipy, tmp_path):
    """`--model FILE` alone (VAE and text encoder found beside it), `--scheduler beta` without scipy, stderr
    neither a terminal nor UTF-8: the plan line, phases and step lines; outputs with the umask's permissions."""
    out, latents = tmp_path / "out" / "clip.mp4", tmp_path / "out" / "latents.safetensors"
    env = {**no_scipy, "PYTHONIOENCODING": "ascii"}
    command = ["generate", "--model", str(tiny_models["t2v"]), "--prompt", "a fox", "--out", str(out),
               "--save-latents", str(latents), "--scheduler", "beta", "--sampler", "euler", *QUICK]
    old = os.umask(0o027)
    try:
        result = run_cli(command, tmp_path, env)
    finally:
        os.umask(old)
    assert result["code"] == 0, result["stderr"]
    plan = next(line for line in result["stderr"].splitlines() if line.startswith("wanmesh generate: "))
    tree = tiny_models["t2v"].parents[1]
    for part in ("a small test model", "32x32, 5 frames, 2 steps, euler/beta", "world 1", "devices cpu",
                 "weights F32 file", "shift from the model's class", "model from --model",
                 f"vae, text encoder from beside --model ({tree})"):
        assert part in plan, plan
    for phase in ("start pool", "encode text", "load VAE", "load model", "sample (2 steps)", "decode", "write"):
        assert f"] {phase}" in result["stderr"], result["stderr"]
    assert "sample step 1/2" in result["stderr"] and "sample step 2/2" in result["stderr"]
    assert result["stdout"].startswith(f"wrote {out} (5 frames") and " in " in result["stdout"]
    for path in (out, latents):
        assert path.stat().st_mode & 0o777 == 0o640, (path, oct(path.stat().st_mode))


def test_quiet_with_timings_prints_only_the_result(tiny_models_root, tmp_path):
    timings = tmp_path / "t.json"
    result = run_cli(["generate", "--models", str(tiny_models_root), "--prompt", "a fox", "--out",
                      str(tmp_path / "clip.mp4"), "--quiet", "--timings", str(timings), *QUICK], tmp_path,
                     {"WANMESH_WORKER_THREADS": "1"})
    assert result["code"] == 0, result["stderr"]
    assert result["stderr"].strip().startswith("timings:") and "sample step" not in result["stderr"]
    assert len(result["stdout"].strip().splitlines()) == 1
    assert "sampling" in json.loads(timings.read_text())["phases_s"]


def test_zip_pickle_with_code_is_refused_before_any_worker(tiny_models, tmp_path):
    import torch

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo ran",))

    evil = tmp_path / "model.ckpt"
    torch.save({"blocks.0.weight": torch.zeros(2), "extra": Payload()}, evil)
    result = run_cli(["generate", "--model", str(evil), "--vae", str(tiny_models["vae"]), "--text-encoder",
                      str(tiny_models["text_encoder"]), "--prompt", "x", "--out", str(tmp_path / "x.mp4"), *QUICK],
                     tmp_path)
    lines = result["stderr"].strip().splitlines()
    assert result["code"] == 2 and len(lines) == 1 and "weights-only" in lines[0], result["stderr"]
    assert "weights_only" not in result["stderr"] and "ran" not in result["stdout"]
    assert not result["pool_started"]


def test_outputs_bigger_than_the_free_space_are_refused(tmp_path):
    from wanmesh.parallel.cli.plan import check_output_space

    with pytest.raises(ValueError, match=r"--out .*x\.mp4 and --save-frames .* need about .* free"):
        check_output_space([("--out", tmp_path / "x.mp4", 10 ** 15), ("--save-frames", tmp_path / "f.safetensors",
                                                                        10 ** 15)])
    check_output_space([("--out", tmp_path / "x.mp4", 1000)])


def test_a_wan_size_on_the_cpu_gets_a_time_estimate_and_a_hint(tiny_models):
    """The estimate is the cost model's step time at this CPU's measured speed; a small test model gets none."""
    import argparse

    from wanmesh.parallel.cli.plan import QUICK_TRY, step_estimate
    from wanmesh.parallel.config import ParallelConfig

    args = argparse.Namespace(small_model=False, width=832, height=480, frames=81, steps=30, guidance_scale=5.0)
    cpu = ParallelConfig(world=1, devices="cpu")
    estimate = step_estimate(args, str(tiny_models["t2v"]), cpu)
    assert "per step on this CPU" in estimate and "for 30 steps at 832x480, 81 frames" in estimate
    assert QUICK_TRY in estimate
    assert step_estimate(argparse.Namespace(**{**vars(args), "small_model": True}), str(tiny_models["t2v"]), cpu) is None
