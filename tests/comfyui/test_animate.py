"""Wan 2.2 Animate in a real ComfyUI (0.33): native ``WanAnimateToVideo`` conditioning (reference image, pose video,
face video, CLIP vision tokens of the reference) sampled by native KSampler on ``UNETLoader``'s model, and by KSampler
on the WanMesh MODEL and by the WanMesh Sampler on the same tiny Animate file, in the same API prompts: both within
1e-4 of native on one rank, and tp 2 x CFG parallel 2 and Ulysses 2 equal to one rank (under CFG parallel each rank
runs one guidance pass, so the unconditional rank computes the face tokens of the negative's face video, which
native sets to -1). The example workflow ``native/animate_native`` runs.

The motion encoder reads 512x512 face frames whatever the model's size, so the face video is one frame and the
sampling two steps: native encodes it at every model call, the pool once per sampling run and pass.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from comfyui_server import ComfyUIServer
from test_comfyui_server import assert_video, run_successfully, saved_video
from workflow_graph import load_workflow, node_of_type
from test_native_sampling import SEED, TOLERANCE, largest_difference, pool_inputs, save_latent, saved

MODEL_FILE = "wan22_tiny_animate.safetensors"
WIDTH, HEIGHT, LENGTH, STEPS = 48, 32, 5, 2
CFG = 3.0  # guided (two rows per call: CFG parallel splits them), less amplified than the other tests' 5
LAYOUTS = {"tp2_cfg2": dict(devices="cpu:4", world=4, tp=2, cfg_parallel=True),
           "ulysses2": dict(devices="cpu:2", world=2, ulysses=2), "world1": dict(devices="cpu:1", world=1)}
SIDES = ("model", "sampler")  # the nodes saving KSampler-on-the-WanMesh-MODEL's and the WanMesh Sampler's latents


def ksampler(model: str) -> dict[str, Any]:
    return {"class_type": "KSampler", "inputs": {
        "model": [model, 0], "positive": ["cond", 0], "negative": ["cond", 1], "latent_image": ["cond", 2],
        "seed": SEED, "steps": STEPS, "cfg": CFG, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}


def wanmesh_sampler() -> dict[str, Any]:
    """The WanMesh Sampler with KSampler's settings (euler / simple run in the workers; shift 8 is the model's)."""
    return {"class_type": "WanMeshSampler", "inputs": {
        "model": ["wm", 0], "positive": ["cond", 0], "negative": ["cond", 1], "latent_image": ["cond", 2],
        "seed": SEED, "steps": STEPS, "cfg": CFG, "shift": 8.0, "sampler_name": "euler", "denoise": 1.0,
        "scheduler": "simple"}}


def animate_prompt(layout: dict[str, Any], native: bool) -> dict[str, Any]:
    """Node ``model`` saves the WanMesh MODEL's latent, ``sampler`` the WanMesh Sampler's, ``native`` (when asked)
    native KSampler's."""
    prompt: dict[str, Any] = {
        "pool": {"class_type": "WanMeshPool", "inputs": pool_inputs(layout)},
        "te": {"class_type": "WanMeshTextEncoderLoader",
               "inputs": {"text_encoder_name": "umt5_native.safetensors", "dtype": "fp32", "pool": ["pool", 0]}},
        "pos": {"class_type": "WanMeshTextEncode", "inputs": {"text_encoder": ["te", 0], "text": "a fox dances"}},
        "neg": {"class_type": "WanMeshTextEncode", "inputs": {"text_encoder": ["te", 0], "text": "blurry"}},
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_tiny_vae.safetensors"}},
        "reference": {"class_type": "LoadImage", "inputs": {"image": "ref_circle.png"}},
        "face": {"class_type": "LoadImage", "inputs": {"image": "ref_texture.png"}},
        # a pose video shorter than the video: native repeats its last frame
        "pose": {"class_type": "RepeatImageBatch", "inputs": {"image": ["face", 0], "amount": 3}},
        "clip": {"class_type": "WanMeshCLIPVisionLoader", "inputs": {"clip_name": "clip_vision_tiny.safetensors"}},
        "clip_reference": {"class_type": "WanMeshCLIPVisionEncode",
                           "inputs": {"clip_vision": ["clip", 0], "image": ["reference", 0], "crop": "center"}},
        "cond": {"class_type": "WanAnimateToVideo", "inputs": {
            "positive": ["pos", 0], "negative": ["neg", 0], "vae": ["vae", 0], "width": WIDTH, "height": HEIGHT,
            "length": LENGTH, "batch_size": 1, "continue_motion_max_frames": 5, "video_frame_offset": 0,
            "reference_image": ["reference", 0], "face_video": ["face", 0], "pose_video": ["pose", 0],
            "clip_vision_output": ["clip_reference", 0]}},
        "wm": {"class_type": "WanMeshModelLoader", "inputs": {"model_name": MODEL_FILE, "dtype": "fp32",
                                                               "pool": ["pool", 0]}},
        "wmodel": {"class_type": "WanMeshNativeModel", "inputs": {"model": ["wm", 0]}},
        "model_k": ksampler("wmodel"),
        "model": save_latent("model_k", "animate_model"),
        "sampler_k": wanmesh_sampler(),
        "sampler": save_latent("sampler_k", "animate_sampler"),
    }
    if native:
        prompt["unet"] = {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL_FILE, "weight_dtype": "default"}}
        prompt["native_k"] = ksampler("unet")
        prompt["native"] = save_latent("native_k", "animate_native")
    return prompt


@pytest.fixture(scope="module")
def latents(recent_comfyui_server: ComfyUIServer) -> dict[tuple[str, str], torch.Tensor]:
    """(side, layout) -> the saved latent; ("native", "world1") -> native KSampler's."""
    found = {}
    for name, layout in LAYOUTS.items():
        result = run_successfully(recent_comfyui_server, animate_prompt(layout, native=name == "world1"))
        for side in SIDES + (("native",) if name == "world1" else ()):
            found[side, name] = saved(recent_comfyui_server, result, side)
    return found


@pytest.mark.parametrize("side", SIDES)
def test_the_wanmesh_side_equals_native_animate(latents, side: str) -> None:
    native = latents["native", "world1"]
    assert native.shape[2] == 1 + (LENGTH - 1) // 4 + 1, "the reference frame comes before the video's latent frames"
    assert native.abs().max().item() > 0.1, "the native latent is flat: the comparison proves nothing"
    difference = largest_difference(native, latents[side, "world1"])
    print(f"Animate, WanMesh {side} vs native: {difference:.3g} (native latent max {native.abs().max().item():.3g})")
    assert difference <= TOLERANCE, f"the WanMesh {side} is {difference:.3g} from native"


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "world1"])
def test_a_parallel_layout_equals_one_rank(latents, layout: str, side: str) -> None:
    difference = largest_difference(latents[side, layout], latents[side, "world1"])
    print(f"Animate, WanMesh {side}, {layout} vs world 1: {difference:.3g}")
    assert difference <= TOLERANCE, f"{side}, {layout}: {difference:.3g} from world 1"


def test_the_animate_workflow_runs(recent_comfyui_server: ComfyUIServer) -> None:
    """``native/animate_native`` (tensor parallel, the reference frame trimmed off) writes the video's frames."""
    prompt = load_workflow("native/api/animate_native.json")
    size = node_of_type(prompt, "WanAnimateToVideo")["inputs"]
    result = run_successfully(recent_comfyui_server, prompt)
    assert_video(saved_video(recent_comfyui_server, result, prompt), size["length"], size["width"], size["height"])
