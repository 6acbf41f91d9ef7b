"""HuMo on the WanMesh MODEL against native ComfyUI 0.33: ComfyUI's ``WanHuMoImageToVideo``
(audio windows from a synthetic whisper output, the zero reference it adds without an image) sampled by ComfyUI's
KSampler path (euler, 4 steps, cfg 5) on ``load_diffusion_model``'s model, on the pool's MODEL (one rank) and by
the WanMesh Sampler with the same conditioning, in ComfyUI's interpreter; the final latents agree to 1e-5 of their
scale."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from test_humo_network import _released_state
from native_scripts import run_in_comfyui

from wanmesh.parallel.networks.wan_humo import WanHumoTransformer3DModel
from wanmesh.parallel.tiny.models import NATIVE_TRANSFORMER, randomise_

SCRIPT = r"""
import sys
humo_file, out_file = sys.argv[1], sys.argv[2]
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import torch, comfy.sd, comfy.sample
from comfy_extras.nodes_wan import WanHuMoImageToVideo
from safetensors.torch import save_file
from wanmesh.parallel.config import ParallelConfig
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.nodes.bridge.runtime import ResidentModel
from wanmesh.nodes.bridge.pool_model import pool_model
from wanmesh.nodes.sampling import WanMeshSampler

generator = torch.Generator().manual_seed(3)
text = torch.randn(1, 512, 4096, generator=generator)
positive, negative = [[text, {}]], [[torch.zeros_like(text), {}]]
audio = {"encoded_audio_all_layers": [torch.randn(1, 50, 1280, generator=generator) for _ in range(33)],
         "audio_samples": 16000}
positive, negative, latent = WanHuMoImageToVideo.execute(positive, negative, None, 48, 32, 9, 1,
                                                         audio_encoder_output=audio).result
noise = torch.randn(latent["samples"].shape, generator=torch.Generator().manual_seed(7))

def sample(model):
    return comfy.sample.sample(model, noise, 4, 5.0, "euler", "simple", positive, negative, latent["samples"], seed=7)

runner = PoolRunner.for_config(ParallelConfig(world=1, devices="cpu"), previews=False)
resident = ResidentModel(runner, runner.load_model(humo_file, dtype="fp32"), path=humo_file)
(sampled,) = WanMeshSampler().sample(resident, positive, negative, latent, 7, 4, 5.0, 8.0, "euler", 1.0,
                                     scheduler="simple")
save_file({"native": sample(comfy.sd.load_diffusion_model(humo_file)).contiguous(),
           "pool": sample(pool_model(resident)).contiguous(), "sampler": sampled["samples"].contiguous()}, out_file)
"""


def test_humo_on_the_wanmesh_model_equals_native(recent_comfyui_dir: Path, tmp_path: Path) -> None:
    config = dict(NATIVE_TRANSFORMER)
    model = WanHumoTransformer3DModel(**config)
    randomise_(model, 5)
    file = tmp_path / "humo.safetensors"
    save_file(_released_state(model, config), str(file), metadata={"num_heads": str(config["num_attention_heads"])})
    run_in_comfyui(SCRIPT, recent_comfyui_dir, file, tmp_path / "out.safetensors")
    out = load_file(str(tmp_path / "out.safetensors"))
    scale = out["native"].abs().max().item()
    assert scale > 1.0
    assert (out["pool"] - out["native"]).abs().max().item() <= 1e-5 * scale
    assert (out["sampler"] - out["native"]).abs().max().item() <= 1e-5 * scale
    assert torch.isfinite(out["pool"]).all()
