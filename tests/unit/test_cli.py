"""`wanmesh generate` end to end on the tiny models through the worker pool: files, determinism, world 2, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import cv2
import pytest
import torch
from safetensors.torch import load_file

from wanmesh.parallel.cli import main


def _generate(models, out_dir, name: str, *extra: str) -> dict:
    main([
        "generate", "--models", str(models), "--prompt", "a red fox running through snow", "--negative", "blurry",
        "--width", "64", "--height", "48", "--frames", "5", "--steps", "3", "--seed", "7", "--device", "cpu",
        "--out", str(out_dir / f"{name}.mp4"), "--save-latents", str(out_dir / f"{name}_latents.safetensors"),
        "--save-frames", str(out_dir / f"{name}_frames.safetensors"), *extra,
    ])
    return {
        "latents": load_file(out_dir / f"{name}_latents.safetensors")["latents"],
        "frames": load_file(out_dir / f"{name}_frames.safetensors")["frames"],
    }


def test_generate_writes_video_latents_and_frames_deterministically(tiny_models, tmp_path):
    models = tiny_models["t2v"].parent.parent
    first = _generate(models, tmp_path, "a")
    again = _generate(models, tmp_path, "b")
    other = _generate(models, tmp_path, "c", "--seed", "8")
    two_ranks = _generate(models, tmp_path, "d", "--world", "2")
    assert first["latents"].shape == (1, 16, 2, 6, 8) and first["latents"].dtype == torch.float32
    assert first["frames"].shape == (5, 48, 64, 3)
    assert 0.0 <= float(first["frames"].min()) and float(first["frames"].max()) <= 1.0
    assert torch.equal(first["latents"], again["latents"]) and torch.equal(first["frames"], again["frames"])
    assert not torch.equal(first["latents"], other["latents"])
    torch.testing.assert_close(two_ranks["latents"], first["latents"], rtol=0, atol=1e-5)
    torch.testing.assert_close(two_ranks["frames"], first["frames"], rtol=0, atol=1e-5)
    video = cv2.VideoCapture(str(tmp_path / "a.mp4"))
    count = 0
    while True:
        ok, frame = video.read()
        if not ok:
            break
        assert frame.shape == (48, 64, 3)
        count += 1
    assert count == 5


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--width", "100"], "width 100 is not a positive multiple of 8 (nearest valid: 96 or 104)"),
        (["--frames", "10"], "frame count 10 is not of the form 4k+1 (nearest valid: 9 or 13)"),
        (["--world", "3", "--device", "cpu", "--tp", "2"], "world=3 is not a multiple of cfg x ulysses x ring x tp"),
        (["--vae-tile", "60"], "tile_px must be a positive multiple of the VAE's spatial factor 8, got 60"),
        (["--world", "0"], "world must be a positive integer, got 0"),
        (["--model", "x.safetensors"], "--model x.safetensors does not exist"),  # --model replaces the tree's model
        (["--world", "2", "--layout", "auto", "--tp", "2"], "--layout auto chooses the degrees itself; leave out --tp"),
    ],
)
def test_bad_arguments_fail_fast_with_clear_messages(tiny_models, tmp_path, flags, message):
    result = subprocess.run(
        [sys.executable, "-m", "wanmesh.parallel.cli", "generate", "--models", str(tiny_models["t2v"].parent.parent),
         "--prompt", "x", "--out", str(tmp_path / "x.mp4"), *flags],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "x.mp4").exists()


def test_layout_auto_logs_its_choice_matches_one_rank_and_writes_the_timings(tiny_models, tmp_path, monkeypatch,
                                                                               capsys):
    """--layout auto on two ranks: the cost model's table on stderr, one rank's latents, the calibration cached
    where the user can read it, and --timings' breakdown with every phase and each rank's steps."""
    monkeypatch.setenv("WANMESH_CACHE", str(tmp_path / "cache"))
    models = tiny_models["t2v"].parent.parent
    single = _generate(models, tmp_path, "single")
    capsys.readouterr()
    auto = _generate(models, tmp_path, "auto", "--world", "2", "--layout", "auto", "--timings",
                     str(tmp_path / "timings.json"))
    log = capsys.readouterr().err
    assert "auto layout (64x48, 5 frames, 3 steps):" in log and "\n* " in log, log
    torch.testing.assert_close(auto["latents"], single["latents"], rtol=0, atol=1e-5)
    (calibration,) = (tmp_path / "cache" / "calibration").glob("*world2.json")
    assert json.loads(calibration.read_text())["world"] == 2
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert {"pool_start", "text_encode", "vae_load", "weight_load", "sampling", "vae_decode", "write"} <= set(
        timings["phases_s"]) and all(seconds >= 0 for seconds in timings["phases_s"].values())
    assert [rank["rank"] for rank in timings["ranks"]] == [0, 1] and timings["transfer_s"] >= 0
    for rank in timings["ranks"]:
        assert len(rank["steps"]) == 3
        for step in rank["steps"]:
            assert step["wall_s"] >= step["communication_s"] >= 0 and step["compute_s"] >= 0
    assert "timings: 3 steps, median" in log
