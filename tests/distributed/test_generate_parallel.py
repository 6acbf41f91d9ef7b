"""Parallel runs through the worker pool equal one rank: `wanmesh generate` with tp / vae patch, and dp batches."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pool_helpers import one_thread_per_worker  # noqa: F401
import torch
from safetensors.torch import load_file

from wanmesh.parallel.cli import main
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.config import ParallelConfig
from wanmesh.parallel.driver.pool import WorkerPool
from wanmesh.parallel.protocol import SampleRequest
from wanmesh.parallel.config import latent_shape


@pytest.fixture(scope="module")
def models(tiny_models_root):
    return tiny_models_root


def _run_generate(models, out_dir, name: str, *flags: str) -> int:
    return main([
        "generate", "--models", str(models), "--prompt", "a lighthouse at night", "--negative", "blurry",
        "--width", "160", "--height", "128", "--frames", "5", "--steps", "4", "--sampler", "unipc", "--seed", "3",
        "--device", "cpu", "--out", str(out_dir / f"{name}.mp4"),
        "--save-latents", str(out_dir / f"{name}_l.safetensors"), "--save-frames", str(out_dir / f"{name}_f.safetensors"),
        *flags,
    ])


def _generate(models, out_dir, name: str, *flags: str) -> dict[str, torch.Tensor]:
    assert _run_generate(models, out_dir, name, *flags) == 0
    return {
        "latents": load_file(out_dir / f"{name}_l.safetensors")["latents"],
        "frames": load_file(out_dir / f"{name}_f.safetensors")["frames"],
    }


def test_tp2_and_vae_patch2_equal_one_rank(models, tmp_path):
    tiles = ["--vae-tile", "64"]
    single = _generate(models, tmp_path, "single", "--world", "1", *tiles)
    tp = _generate(models, tmp_path, "tp2", "--world", "2", "--tp", "2", *tiles)
    patch = _generate(models, tmp_path, "patch2", "--world", "2", "--vae-patch", "2", *tiles)
    assert single["frames"].shape == (5, 128, 160, 3)
    assert single["latents"].std() > 0.1
    assert (tp["latents"] - single["latents"]).abs().max() <= 1e-4
    assert torch.equal(patch["latents"], single["latents"])  # vae patch does not touch sampling
    assert (patch["frames"] - single["frames"]).abs().max() <= 1e-5


def test_tp_that_does_not_divide_the_heads_is_refused(models, tmp_path, capsys):
    assert _run_generate(models, tmp_path, "bad", "--world", "3", "--tp", "3") == 2  # bad input
    assert "4 attention heads" in capsys.readouterr().err
    assert not (tmp_path / "bad.mp4").exists()


def test_data_parallel_batch_split_equals_one_rank(models):
    shape = latent_shape(64, 48, 5, batch=3)
    embeddings = [torch.randn(6, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    request = SampleRequest(
        handle="", latent=torch.zeros(shape), positive=embeddings[:1], negative=embeddings[1:], seed=11, steps=3, guidance_scale=4.0,
        shift=3.0, sampler="unipc",
    )
    results = {}
    for world in (1, 2):
        with WorkerPool(ParallelConfig(world=world, devices="cpu"), timeout_s=300) as pool:
            runner = PoolRunner(pool)
            handle = runner.load_model(str(models / "diffusion_models" / "wan_tiny_t2v.safetensors"))
            results[world] = runner.sample(replace(request, handle=handle))
    assert results[1].shape == shape
    # batch size changes the CPU GEMM blocking, so rows agree to float tolerance, not bit for bit
    assert (results[2] - results[1]).abs().max() <= 1e-4
    assert (results[1][0] - results[1][1]).abs().max() > 1e-3, "rows must differ (different noise per row)"
