"""A video whose size is a multiple of 8 but not 16 (72x40 px: a 5x9 latent, odd both ways) samples on every layout.

The transformer pads the latent to its 2x2 patches and crops back; with 9 frames (3 latent frames) the padded
sequence has 3 x 3 x 5 = 45 tokens, which two sequence ranks cannot split evenly. Ulysses 2, ring 2 and tp 2 must
give the one-rank latents on the same seed; ``wanmesh generate`` makes the 72x40 video end to end.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from pool_helpers import one_thread_per_worker  # noqa: F401
import torch
from safetensors.torch import load_file

from wanmesh.parallel.cli import main
from wanmesh.parallel.config import ParallelConfig, latent_shape
from wanmesh.parallel.driver.pool import WorkerPool
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.protocol import SampleRequest

WIDTH, HEIGHT, FRAMES = 72, 40, 9
LAYOUTS = {"ulysses2": {"ulysses": 2}, "ring2": {"ring": 2}, "tp2": {"tp": 2}}


@pytest.fixture(scope="module")
def models(tiny_models_root):
    return tiny_models_root


def _sample(models, request: SampleRequest, **layout) -> torch.Tensor:
    world = max(layout.values(), default=1)
    with WorkerPool(ParallelConfig(world=world, devices="cpu", **layout), timeout_s=300) as pool:
        runner = PoolRunner(pool)
        handle = runner.load_model(str(models / "diffusion_models" / "wan_tiny_t2v.safetensors"))
        return runner.sample(replace(request, handle=handle))


def test_sequence_and_tensor_parallel_equal_one_rank_on_an_odd_latent(models):
    shape = latent_shape(WIDTH, HEIGHT, FRAMES)
    assert shape == (1, 16, 3, 5, 9)
    embeddings = [torch.randn(6, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    request = SampleRequest(handle="", latent=torch.zeros(shape), positive=embeddings[:1], negative=embeddings[1:],
                            seed=5, steps=3, guidance_scale=4.0, shift=3.0, sampler="unipc")
    single = _sample(models, request)
    assert single.shape == shape and single.std() > 0.1
    for name, layout in LAYOUTS.items():
        difference = float((_sample(models, request, **layout) - single).abs().max())
        assert difference <= 1e-4, f"{name} differs from one rank by {difference}"


def test_generate_makes_a_video_of_a_size_that_is_not_a_multiple_of_16(models, tmp_path):
    code = main(["generate", "--models", str(models), "--prompt", "a lighthouse", "--width", str(WIDTH),
                 "--height", str(HEIGHT), "--frames", "5", "--steps", "2", "--seed", "1", "--device", "cpu",
                 "--world", "2", "--ulysses", "2", "--vae-tile", "32", "--out", str(tmp_path / "odd.mp4"),
                 "--save-latents", str(tmp_path / "l.safetensors"), "--save-frames", str(tmp_path / "f.safetensors")])
    assert code == 0
    assert load_file(tmp_path / "l.safetensors")["latents"].shape == (1, 16, 2, 5, 9)
    frames = load_file(tmp_path / "f.safetensors")["frames"]
    assert frames.shape == (5, HEIGHT, WIDTH, 3) and frames.std() > 0.01
    assert (tmp_path / "odd.mp4").stat().st_size > 0
