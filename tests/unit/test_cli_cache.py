"""`wanmesh generate --cache` and `wanmesh stream --cache` on the tiny models: steps skipped and reported, world 2
(Ulysses) gives world 1's latents with the same cache, bad cache settings fail in one line before any work."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from wanmesh.parallel.cli import main

REPORT = re.compile(r"step cache teacache: (\d+) steps computed, (\d+) skipped")


def _generate(models, out_dir, name: str, *extra: str):
    main(["generate", "--models", str(models), "--prompt", "a red fox", "--negative", "blurry", "--width", "48",
          "--height", "48", "--frames", "1", "--steps", "6", "--seed", "3", "--device", "cpu",
          "--out", str(out_dir / f"{name}.mp4"), "--save-latents", str(out_dir / f"{name}.safetensors"), *extra])
    return load_file(out_dir / f"{name}.safetensors")["latents"]


def test_generate_with_a_cache_skips_steps_on_every_layout(tiny_models, tmp_path, capsys):
    models = tiny_models["t2v"].parent.parent
    cached = _generate(models, tmp_path, "cached", "--cache", "teacache:0.5:start=0.1")
    err = capsys.readouterr().err
    report = REPORT.search(err)
    assert report and int(report.group(2)) >= 1 and int(report.group(1)) + int(report.group(2)) == 6
    assert "transformer calls; the generic rule (no published numbers for this model)" in err  # the fallback
    two = _generate(models, tmp_path, "two", "--cache", "teacache:0.5:start=0.1", "--world", "2", "--ulysses", "2")
    assert REPORT.search(capsys.readouterr().err).groups() == report.groups()
    assert (two - cached).abs().max() <= 1e-4


@pytest.mark.parametrize("cache, message", [
    ("easycache:0.2", "method 'easycache' is unknown; valid: teacache, magcache, fbcache"),
    ("teacache:-1", "cache threshold -1.0 is invalid"),
    ("magcache:0.1:start=0.6:end=0.4", "cache start_percent 0.6 is after end_percent 0.4"),
])
def test_bad_cache_settings_fail_before_work(tiny_models, tmp_path, cache, message):
    result = subprocess.run(
        [sys.executable, "-m", "wanmesh.parallel.cli", "generate", "--models", str(tiny_models["t2v"].parent.parent),
         "--prompt", "x", "--out", str(tmp_path / "x.mp4"), "--cache", cache],
        capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and message in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1
    assert not (tmp_path / "x.mp4").exists()


def test_stream_with_a_cache_reports_computed_and_skipped_steps(tiny_models, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    main(["stream", "--models", str(tiny_models["t2v"].parent.parent), "--prompt", "a fox", "--width", "32",
          "--height", "32", "--frames", "13", "--chunk", "2", "--steps", "4", "--seed", "3", "--device", "cpu",
          "--cache", "teacache:2.0:start=0.1", "--out", str(tmp_path / "v.mp4"), "--chunk-dir", str(tmp_path / "c")])
    report = REPORT.search(capsys.readouterr().err)
    assert report, "no step cache line"
    assert int(report.group(1)) + int(report.group(2)) == 2 * 4  # 4 latent frames: two chunks of 4 steps
    assert int(report.group(2)) >= 1
    assert (tmp_path / "v.mp4").is_file()


@pytest.mark.parametrize("cache, message", [
    (["easycache:0.2"], "method 'easycache' is unknown; valid: teacache, magcache, fbcache"),
    (["teacache:-1"], "cache threshold -1.0 is invalid"),
    (["fbcache:0.1", "--no-kv-cache"], "step cache fbcache needs the KV cache while streaming"),
])
def test_bad_stream_cache_settings_fail_before_work(tiny_models, tmp_path, cache, message):
    result = subprocess.run(
        [sys.executable, "-m", "wanmesh.parallel.cli", "stream", "--models", str(tiny_models["t2v"].parent.parent),
         "--prompt", "x", "--out", str(tmp_path / "x.mp4"), "--chunk-dir", str(tmp_path / "c"), "--cache", *cache],
        capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and message in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1
    assert not (tmp_path / "c").exists()
