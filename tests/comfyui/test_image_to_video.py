"""Image-to-video in a real ComfyUI (recent, with native Wan nodes): native conditioning and sampling against
WanMesh's on the same tiny files, as API prompts.

For each model kind (Wan 2.1 I2V with CLIP vision tokens, FLF2V with a start and an end image, a Wan 2.2 I2V A14B
expert without CLIP vision) one prompt holds: native ``WanImageToVideo`` / ``WanFirstLastFrameToVideo`` conditioning
(native VAE; CLIP vision tokens from WanMesh CLIP Vision Encode, as a tiny CLIP vision cannot be loaded by native
``CLIPVisionLoader``, which knows only released sizes) sampled by native KSampler on ``UNETLoader``'s model, by
KSampler on the WanMesh MODEL and by the WanMesh Sampler; and WanMesh Image To Video's conditioning (WanMesh VAE on
the pool) sampled by the WanMesh Sampler. All four within 1e-4 of native; a parallel layout equals one rank. The
start and end images have other sizes and aspects than the video, so resizing and cropping are compared too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from comfyui_server import ComfyUIServer
from test_comfyui_server import run_successfully
from test_native_sampling import CFG, NATIVE_SHIFT, SEED, STEPS, TOLERANCE, largest_difference, pool_inputs, save_latent, saved

WIDTH, HEIGHT, LENGTH = 48, 32, 9
KINDS = {  # kind: (model file, native conditioning node, takes CLIP vision)
    "i2v": ("wan_tiny_i2v.safetensors", "WanImageToVideo", True),
    "flf2v": ("wan_tiny_flf2v.safetensors", "WanFirstLastFrameToVideo", True),
    "wan22_i2v": ("wan22_tiny_i2v_high.safetensors", "WanImageToVideo", False),
}
LAYOUTS = {"world1": dict(devices="cpu:1", world=1), "ulysses2": dict(devices="cpu:2", world=2, ulysses=2)}
SIDES = ("native", "model", "sampler", "wanmesh_i2v")


def native_conditioning(kind: str) -> dict[str, Any]:
    _, node, clip = KINDS[kind]
    inputs = {"positive": ["pos", 0], "negative": ["neg", 0], "vae": ["vae", 0], "width": WIDTH, "height": HEIGHT,
              "length": LENGTH, "batch_size": 1, "start_image": ["start", 0]}
    if node == "WanFirstLastFrameToVideo":
        inputs.update(end_image=["end", 0], clip_vision_start_image=["clip_start", 0],
                      clip_vision_end_image=["clip_end", 0])
    elif clip:
        inputs["clip_vision_output"] = ["clip_start", 0]
    return {"class_type": node, "inputs": inputs}


def wanmesh_conditioning(kind: str) -> dict[str, Any]:
    _, node, clip = KINDS[kind]
    inputs = {"positive": ["pos", 0], "negative": ["neg", 0], "vae": ["wvae", 0], "width": WIDTH, "height": HEIGHT,
              "length": LENGTH, "batch_size": 1, "start_image": ["start", 0]}
    if clip:
        inputs["clip_vision_output"] = ["clip_start", 0]
    if node == "WanFirstLastFrameToVideo":
        inputs.update(end_image=["end", 0], clip_vision_end_output=["clip_end", 0])
    return {"class_type": "WanMeshImageToVideo", "inputs": inputs}


def ksampler(model: str, conditioning: str) -> dict[str, Any]:
    return {"class_type": "KSampler", "inputs": {
        "model": [model, 0], "positive": [conditioning, 0], "negative": [conditioning, 1],
        "latent_image": [conditioning, 2], "seed": SEED, "steps": STEPS, "cfg": CFG, "sampler_name": "euler",
        "scheduler": "simple", "denoise": 1.0}}


def wanmesh_sampler(model: str, conditioning: str) -> dict[str, Any]:
    return {"class_type": "WanMeshSampler", "inputs": {
        "model": [model, 0], "positive": [conditioning, 0], "negative": [conditioning, 1],
        "latent_image": [conditioning, 2], "seed": SEED, "steps": STEPS, "cfg": CFG, "shift": NATIVE_SHIFT,
        "sampler_name": "euler", "denoise": 1.0, "scheduler": "simple"}}


def i2v_prompt(layout: dict[str, Any]) -> dict[str, Any]:
    """Every kind's four samplings; node ``{kind}_{side}`` saves the latent of that side."""
    prompt: dict[str, Any] = {
        "pool": {"class_type": "WanMeshPool", "inputs": pool_inputs(layout)},
        "te": {"class_type": "WanMeshTextEncoderLoader",
               "inputs": {"text_encoder_name": "umt5_native.safetensors", "dtype": "fp32", "pool": ["pool", 0]}},
        "pos": {"class_type": "WanMeshTextEncode", "inputs": {"text_encoder": ["te", 0], "text": "a fox runs"}},
        "neg": {"class_type": "WanMeshTextEncode", "inputs": {"text_encoder": ["te", 0], "text": "blurry"}},
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_tiny_vae.safetensors"}},
        "wvae": {"class_type": "WanMeshVAELoader",
                 "inputs": {"vae_name": "wan_tiny_vae.safetensors", "dtype": "fp32", "pool": ["pool", 0]}},
        "start": {"class_type": "LoadImage", "inputs": {"image": "ref_circle.png"}},
        "end": {"class_type": "LoadImage", "inputs": {"image": "ref_texture.png"}},
        "clip": {"class_type": "WanMeshCLIPVisionLoader", "inputs": {"clip_name": "clip_vision_tiny.safetensors"}},
        "clip_start": {"class_type": "WanMeshCLIPVisionEncode",
                       "inputs": {"clip_vision": ["clip", 0], "image": ["start", 0], "crop": "center"}},
        "clip_end": {"class_type": "WanMeshCLIPVisionEncode",
                     "inputs": {"clip_vision": ["clip", 0], "image": ["end", 0], "crop": "center"}},
    }
    for kind, (model_file, _, _) in KINDS.items():
        prompt[f"{kind}_unet"] = {"class_type": "UNETLoader", "inputs": {"unet_name": model_file, "weight_dtype": "default"}}
        prompt[f"{kind}_wm"] = {"class_type": "WanMeshModelLoader",
                                "inputs": {"model_name": model_file, "dtype": "fp32", "pool": ["pool", 0]}}
        prompt[f"{kind}_wmodel"] = {"class_type": "WanMeshNativeModel", "inputs": {"model": [f"{kind}_wm", 0]}}
        prompt[f"{kind}_cond"] = native_conditioning(kind)
        prompt[f"{kind}_wcond"] = wanmesh_conditioning(kind)
        samplers = {"native": ksampler(f"{kind}_unet", f"{kind}_cond"),
                    "model": ksampler(f"{kind}_wmodel", f"{kind}_cond"),
                    "sampler": wanmesh_sampler(f"{kind}_wm", f"{kind}_cond"),
                    "wanmesh_i2v": wanmesh_sampler(f"{kind}_wm", f"{kind}_wcond")}
        for side, node in samplers.items():
            prompt[f"{kind}_{side}_k"] = node
            prompt[f"{kind}_{side}"] = save_latent(f"{kind}_{side}_k", f"i2v_{kind}_{side}")
    return prompt


@pytest.fixture(scope="module")
def layout_latents(recent_comfyui_server: ComfyUIServer) -> dict[str, dict[str, torch.Tensor]]:
    latents = {}
    for name, layout in LAYOUTS.items():
        result = run_successfully(recent_comfyui_server, i2v_prompt(layout))
        latents[name] = {f"{kind}_{side}": saved(recent_comfyui_server, result, f"{kind}_{side}")
                         for kind in KINDS for side in SIDES}
    return latents


@pytest.mark.parametrize("side", SIDES[1:])
@pytest.mark.parametrize("kind", KINDS)
def test_wanmesh_equals_native_image_to_video(layout_latents, kind: str, side: str) -> None:
    native, wanmesh = layout_latents["world1"][f"{kind}_native"], layout_latents["world1"][f"{kind}_{side}"]
    assert native.abs().max().item() > 0.1, "the native latent is flat: the comparison proves nothing"
    difference = largest_difference(native, wanmesh)
    assert difference <= TOLERANCE, f"{kind} {side}: {difference:.3g} from native"


@pytest.mark.parametrize("kind", KINDS)
def test_parallel_layout_equals_one_rank(layout_latents, kind: str) -> None:
    for side in SIDES[1:]:
        difference = largest_difference(layout_latents["ulysses2"][f"{kind}_{side}"],
                                        layout_latents["world1"][f"{kind}_{side}"])
        assert difference <= TOLERANCE, f"ulysses 2 {kind} {side}: {difference:.3g} from world 1"


def test_the_kinds_differ(layout_latents) -> None:
    """The image conditioning reaches the models: the three kinds' latents differ far beyond the tolerance."""
    world1 = layout_latents["world1"]
    assert largest_difference(world1["i2v_native"], world1["flf2v_native"]) > 100 * TOLERANCE
