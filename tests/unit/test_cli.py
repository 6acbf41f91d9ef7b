"""`wanmesh generate` end to end on the tiny models through the worker pool: files, determinism, world 2, errors."""

from __future__ import annotations

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
        (["--model", "x.safetensors"], "give either --models DIR or --model/--vae/--text-encoder, not both"),
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
