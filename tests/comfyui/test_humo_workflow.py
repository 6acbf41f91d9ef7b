"""HuMo in a real ComfyUI 0.33 server, as API prompts.

Native ``WanHuMoImageToVideo`` gets its audio from a test-only node standing in for ``AudioEncoderLoader`` +
``AudioEncoderEncode`` (whose whisper-large model is too big for CI): it returns the AUDIO_ENCODER_OUTPUT whisper
gives, 33 hidden states of width 1280 at 50 per second. Into native KSampler on ``UNETLoader``'s model, KSampler on
the WanMesh MODEL and the WanMesh Sampler, on a tiny HuMo file: all within 1e-5 of the latents' scale of native;
Ulysses 2 and tp 2 give the one-rank latents. In bf16, world 1 is within the dtype matrix's bound of fp32 and
Ulysses 2 within its layout bound of world 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from checks import DTYPE_TOLERANCE, LAYOUT_TOLERANCE, MIN_HALF_ERROR, relative_error
from comfyui_server import ComfyUIServer, RecentComfyUIServer
from conftest import _serve
from safetensors.torch import save_file
from test_humo_network import _released_state
from test_native_sampling import largest_difference, pool_and_prompts, save_latent, saved
from test_comfyui_server import run_successfully

from wanmesh.parallel.networks.wan_humo import WanHumoTransformer3DModel
from wanmesh.parallel.tiny.models import NATIVE_TRANSFORMER, randomise_

MODEL_FILE = "wan_tiny_humo.safetensors"
AUDIO_NODE = "WanMeshTestAudioFeatures"
AUDIO_NODE_SOURCE = '''
import torch


class WanMeshTestAudioFeatures:
    """Test-only: the AUDIO_ENCODER_OUTPUT whisper-large gives (33 hidden states, width 1280, 50 per second)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seconds": ("FLOAT", {"default": 1.0}), "seed": ("INT", {"default": 0})}}

    RETURN_TYPES = ("AUDIO_ENCODER_OUTPUT",)
    FUNCTION = "features"
    CATEGORY = "testing"

    def features(self, seconds, seed):
        generator = torch.Generator().manual_seed(seed)
        frames = int(50 * seconds)
        layers = [torch.randn(1, frames, 1280, generator=generator) for _ in range(33)]
        return ({"encoded_audio_all_layers": layers, "audio_samples": int(16000 * seconds)},)


NODE_CLASS_MAPPINGS = {"WanMeshTestAudioFeatures": WanMeshTestAudioFeatures}
'''
LAYOUTS = {"world1": dict(devices="cpu:1", world=1), "ulysses2": dict(devices="cpu:2", world=2, ulysses=2),
           "tp2": dict(devices="cpu:2", world=2, tp=2)}
SCALE_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def humo_server(recent_comfyui_dir: Path, tiny_models_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyUIServer]:
    """A ComfyUI 0.33 server with the tiny HuMo file in its models and the test-only audio node installed."""
    model = WanHumoTransformer3DModel(**NATIVE_TRANSFORMER)
    randomise_(model, 5)
    save_file(_released_state(model, dict(NATIVE_TRANSFORMER)), str(tiny_models_dir / "diffusion_models" / MODEL_FILE),
              metadata={"num_heads": str(NATIVE_TRANSFORMER["num_attention_heads"])})
    node_file = recent_comfyui_dir / "custom_nodes" / "wanmesh_test_audio_features.py"
    node_file.write_text(AUDIO_NODE_SOURCE)
    try:
        yield from _serve(RecentComfyUIServer, recent_comfyui_dir, tiny_models_dir, tmp_path_factory)
    finally:
        node_file.unlink(missing_ok=True)


def humo_prompt(layout: dict[str, Any], native: bool, dtype: str = "fp32") -> dict[str, Any]:
    """Nodes ``native`` (when asked), ``model`` and ``sampler`` save each side's latents (WanMesh computing in
    ``dtype``)."""
    prompt = {**pool_and_prompts(layout),
              "vae": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_tiny_vae.safetensors"}},
              "audio": {"class_type": AUDIO_NODE, "inputs": {"seconds": 1.0, "seed": 3}},
              "humo": {"class_type": "WanHuMoImageToVideo", "inputs": {
                  "positive": ["pos", 0], "negative": ["neg", 0], "vae": ["vae", 0], "width": 48, "height": 32,
                  "length": 9, "batch_size": 1, "audio_encoder_output": ["audio", 0]}},
              "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL_FILE, "weight_dtype": "default"}},
              "wm": {"class_type": "WanMeshModelLoader",
                     "inputs": {"model_name": MODEL_FILE, "dtype": dtype, "pool": ["pool", 0]}},
              "wmodel": {"class_type": "WanMeshNativeModel", "inputs": {"model": ["wm", 0]}}}
    common = {"positive": ["humo", 0], "negative": ["humo", 1], "latent_image": ["humo", 2], "seed": 7, "steps": 4,
              "cfg": 5.0, "sampler_name": "euler", "denoise": 1.0, "scheduler": "simple"}
    sides = {"model": {"class_type": "KSampler", "inputs": {**common, "model": ["wmodel", 0]}},
             "sampler": {"class_type": "WanMeshSampler", "inputs": {**common, "model": ["wm", 0], "shift": 8.0}}}
    if native:
        sides["native"] = {"class_type": "KSampler", "inputs": {**common, "model": ["unet", 0]}}
    for side, node in sides.items():
        prompt[f"{side}_k"] = node
        prompt[side] = save_latent(f"{side}_k", f"humo_{side}")
    return prompt


@pytest.fixture(scope="module")
def latents(humo_server: ComfyUIServer) -> dict[str, dict[str, torch.Tensor]]:
    found = {}
    for name, layout in LAYOUTS.items():
        result = run_successfully(humo_server, humo_prompt(layout, native=name == "world1"))
        found[name] = {side: saved(humo_server, result, side)
                       for side in (("native", "model", "sampler") if name == "world1" else ("model", "sampler"))}
    return found


@pytest.mark.parametrize("side", ["model", "sampler"])
def test_humo_equals_native(latents, side: str) -> None:
    native = latents["world1"]["native"]
    scale = native.abs().max().item()
    assert scale > 1.0
    assert largest_difference(latents["world1"][side], native) <= SCALE_TOLERANCE * scale


@pytest.mark.parametrize("layout", ["ulysses2", "tp2"])
def test_parallel_layout_equals_one_rank(latents, layout: str) -> None:
    for side in ("model", "sampler"):
        reference = latents["world1"][side]
        assert largest_difference(latents[layout][side], reference) <= SCALE_TOLERANCE * reference.abs().max().item()


# bf16 (every GPU's dtype) at world 1 and Ulysses 2 (HuMo's audio attention groups a rank's sequence slice by frame),
# on the WanMesh MODEL and in the WanMesh Sampler; bounds are the dtype matrix's (tests/checks.py).
BF16_LAYOUTS = ("world1", "ulysses2")


@pytest.fixture(scope="module")
def bf16_latents(humo_server: ComfyUIServer) -> dict[str, dict[str, torch.Tensor]]:
    found = {}
    for name in BF16_LAYOUTS:
        result = run_successfully(humo_server, humo_prompt(LAYOUTS[name], native=False, dtype="bf16"))
        found[name] = {side: saved(humo_server, result, side) for side in ("model", "sampler")}
    return found


@pytest.mark.parametrize("side", ["model", "sampler"])
def test_humo_in_bf16_is_close_to_fp32_and_ulysses2_to_one_rank(bf16_latents, latents, side: str) -> None:
    world1 = bf16_latents["world1"][side]
    assert MIN_HALF_ERROR < relative_error(world1, latents["world1"][side]) <= DTYPE_TOLERANCE["bf16"]
    assert relative_error(bf16_latents["ulysses2"][side], world1) <= LAYOUT_TOLERANCE["bf16"]
