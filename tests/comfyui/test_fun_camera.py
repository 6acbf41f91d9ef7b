"""Wan 2.1 and Wan 2.2 Fun Camera in a real ComfyUI (recent): native ``WanCameraEmbedding`` ->
``WanCameraImageToVideo`` sampled by native KSampler on ``UNETLoader``'s model, by KSampler on the WanMesh MODEL and
by the WanMesh Sampler, on the same tiny Fun Camera files (Wan 2.1's: 32 input channels and image tokens; Wan 2.2's:
36 input channels, the mask before the start latents, no image tokens), as API prompts.

Two conditionings per model: a start image (with its CLIP vision tokens for Wan 2.1) and a panning camera, and a
zooming camera alone (no start image: the image channels stay empty). All within 1e-4 of native; Ulysses 2 and tp 2
x CFG parallel 2 equal one rank, in fp32 and (the Wan 2.2 file) in bf16; the camera embedding changes the result (native without it is far from native
with it); the example workflow runs; a camera embedding of another length than the video is refused in one line.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from checks import DTYPE_TOLERANCE, LAYOUT_TOLERANCE, MIN_HALF_ERROR, relative_error
from comfyui_server import ComfyUIServer
from comfyui_server import RejectedPrompt
from test_comfyui_server import PROMPT_TIMEOUT_S, assert_video, run_successfully, saved_video
from test_image_to_video import CLIP_START, START, ksampler, wanmesh_sampler
from test_native_sampling import TOLERANCE, largest_difference, pool_and_prompts, save_latent, saved
from workflow_graph import load_workflow, node_of_type

WIDTH, HEIGHT, LENGTH = 48, 32, 9
MODEL_FILES = {"21": "wan_tiny_fun_camera.safetensors", "22": "wan22_tiny_fun_camera.safetensors"}
# kind: (camera pose or None, WanCameraImageToVideo's image inputs, the model's MODEL_FILES key)
KINDS = {
    "start_pan": ("Pan Left", {"start_image": START, "clip_vision_output": CLIP_START}, "21"),
    "zoom_only": ("Zoom In", {}, "21"),
    "start_no_camera": (None, {"start_image": START, "clip_vision_output": CLIP_START}, "21"),  # native only
    "start22_pan": ("Pan Right", {"start_image": START}, "22"),
    "zoom22_only": ("Zoom Out", {}, "22"),
    "start22_no_camera": (None, {"start_image": START}, "22"),  # native only
}
NO_CAMERA = {"start_pan": "start_no_camera", "start22_pan": "start22_no_camera"}  # the same without the camera
SIDES = ("native", "model", "sampler")
# Ulysses 2 last, with the example workflow's pool settings: the workflow test and the refusal reuse that pool.
LAYOUTS = {"world1": dict(devices="cpu:1", world=1), "tp2_cfg2": dict(devices="cpu:4", world=4, tp=2, cfg_parallel=True),
           "ulysses2": dict(devices="cpu:2", world=2, ulysses=2, previews=True)}
LAYOUT_KINDS = {"world1": ("start_pan", "zoom_only", "start22_pan", "zoom22_only"), "ulysses2": ("start_pan",),
                "tp2_cfg2": ("start_pan", "start22_pan")}


def camera_conditioning(kind: str, length: int = LENGTH) -> dict[str, dict[str, Any]]:
    """The kind's WanCameraEmbedding (``{kind}_cam``) and WanCameraImageToVideo (``{kind}_cond``) nodes."""
    pose, images, _ = KINDS[kind]
    nodes: dict[str, dict[str, Any]] = {}
    inputs = {"positive": ["pos", 0], "negative": ["neg", 0], "vae": ["vae", 0], "width": WIDTH, "height": HEIGHT,
              "length": LENGTH, "batch_size": 1, **images}
    if pose is not None:
        nodes[f"{kind}_cam"] = {"class_type": "WanCameraEmbedding", "inputs": {
            "camera_pose": pose, "width": WIDTH, "height": HEIGHT, "length": length}}
        inputs["camera_conditions"] = [f"{kind}_cam", 0]
    nodes[f"{kind}_cond"] = {"class_type": "WanCameraImageToVideo", "inputs": inputs}
    return nodes


def camera_prompt(layout: dict[str, Any], kinds: tuple[str, ...], native: bool = True,
                  dtype: str = "fp32") -> dict[str, Any]:
    """Node ``{kind}_{side}`` saves the latent each side samples for each kind (WanMesh computing in ``dtype``)."""
    prompt: dict[str, Any] = {
        **pool_and_prompts(layout),
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_tiny_vae.safetensors"}},
        "start": {"class_type": "LoadImage", "inputs": {"image": "ref_circle.png"}},
        "clip": {"class_type": "WanMeshCLIPVisionLoader", "inputs": {"clip_name": "clip_vision_tiny.safetensors"}},
        "clip_start": {"class_type": "WanMeshCLIPVisionEncode",
                       "inputs": {"clip_vision": ["clip", 0], "image": ["start", 0], "crop": "center"}},
    }
    for model, file in MODEL_FILES.items():
        prompt.update({
            f"unet{model}": {"class_type": "UNETLoader", "inputs": {"unet_name": file, "weight_dtype": "default"}},
            f"wm{model}": {"class_type": "WanMeshModelLoader", "inputs": {"model_name": file, "dtype": dtype,
                                                                         "pool": ["pool", 0]}},
            f"wmodel{model}": {"class_type": "WanMeshNativeModel", "inputs": {"model": [f"wm{model}", 0]}}})
    for kind in kinds:
        prompt.update(camera_conditioning(kind))
        model = KINDS[kind][2]
        samplers = {"native": ksampler(f"unet{model}", f"{kind}_cond"),
                    "model": ksampler(f"wmodel{model}", f"{kind}_cond"),
                    "sampler": wanmesh_sampler(f"wm{model}", f"{kind}_cond")}
        if KINDS[kind][0] is None or not native:
            samplers = {side: node for side, node in samplers.items() if (side == "native") == (KINDS[kind][0] is None)}
        for side, node in samplers.items():
            prompt[f"{kind}_{side}_k"] = node
            prompt[f"{kind}_{side}"] = save_latent(f"{kind}_{side}_k", f"camera_{kind}_{side}")
    return prompt


def sides(kind: str, layout: str) -> tuple[str, ...]:
    if KINDS[kind][0] is None:
        return ("native",)
    return SIDES if layout == "world1" else SIDES[1:]


@pytest.fixture(scope="module")
def layout_latents(recent_comfyui_server: ComfyUIServer) -> dict[str, dict[str, torch.Tensor]]:
    latents = {}
    for name, layout in LAYOUTS.items():
        kinds = LAYOUT_KINDS[name] + (tuple(NO_CAMERA.values()) if name == "world1" else ())
        result = run_successfully(recent_comfyui_server, camera_prompt(layout, kinds, native=name == "world1"))
        latents[name] = {f"{kind}_{side}": saved(recent_comfyui_server, result, f"{kind}_{side}")
                         for kind in kinds for side in sides(kind, name)}
    return latents


@pytest.mark.parametrize("kind, side", [(kind, side) for kind in LAYOUT_KINDS["world1"] for side in SIDES[1:]])
def test_wanmesh_equals_native_fun_camera(layout_latents, kind: str, side: str) -> None:
    native, wanmesh = layout_latents["world1"][f"{kind}_native"], layout_latents["world1"][f"{kind}_{side}"]
    assert native.abs().max().item() > 0.1, "the native latent is flat: the comparison proves nothing"
    difference = largest_difference(native, wanmesh)
    assert difference <= TOLERANCE, f"{kind} {side}: {difference:.3g} from native"


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "world1"])
def test_parallel_layout_equals_one_rank(layout_latents, layout: str) -> None:
    for kind in LAYOUT_KINDS[layout]:
        for side in SIDES[1:]:
            difference = largest_difference(layout_latents[layout][f"{kind}_{side}"],
                                            layout_latents["world1"][f"{kind}_{side}"])
            assert difference <= TOLERANCE, f"{layout} {kind} {side}: {difference:.3g} from world 1"


@pytest.mark.parametrize("kind", NO_CAMERA)
def test_the_camera_embedding_changes_the_video(layout_latents, kind: str) -> None:
    world1 = layout_latents["world1"]
    assert largest_difference(world1[f"{kind}_native"], world1[f"{NO_CAMERA[kind]}_native"]) > 100 * TOLERANCE


def test_fun_camera_workflow_runs(recent_comfyui_server: ComfyUIServer) -> None:
    """The example workflow (WanCameraEmbedding -> WanCameraImageToVideo -> KSampler on the WanMesh MODEL) runs as
    an API prompt and writes an MP4 of the latent's frames."""
    prompt = load_workflow("native/api/fun_camera_native.json")
    latent = node_of_type(prompt, "WanCameraImageToVideo")["inputs"]
    result = run_successfully(recent_comfyui_server, prompt)
    assert_video(saved_video(recent_comfyui_server, result, prompt), latent["length"], latent["width"],
                 latent["height"])


def test_a_camera_embedding_of_another_length_is_one_line(recent_comfyui_server: ComfyUIServer) -> None:
    """Native fails deep in the model on a camera embedding of another length; the WanMesh Sampler names it."""
    prompt = camera_prompt(LAYOUTS["ulysses2"], ())
    prompt.update(camera_conditioning("start_pan", length=LENGTH + 4))
    prompt["bad_k"] = wanmesh_sampler("wm21", "start_pan_cond")
    prompt["bad"] = save_latent("bad_k", "camera_bad")
    result = recent_comfyui_server.run(prompt, PROMPT_TIMEOUT_S)
    assert not isinstance(result, RejectedPrompt) and result.status == "error"
    message = result.error_text()
    assert "camera_conditions has shape" in message and "WanCameraEmbedding" in message, message


# bf16 (every GPU's dtype): the Wan 2.2 file at world 1 and tp 2 x cfg 2 on the WanMesh MODEL and in the WanMesh
# Sampler; bounds (relative, whole latent) are the dtype matrix's (tests/checks.py)
BF16_LAYOUTS, BF16_KIND = ("world1", "tp2_cfg2"), "start22_pan"


@pytest.fixture(scope="module")
def bf16_latents(recent_comfyui_server: ComfyUIServer) -> dict[str, dict[str, torch.Tensor]]:
    latents = {}
    for name in BF16_LAYOUTS:
        result = run_successfully(recent_comfyui_server,
                                  camera_prompt(LAYOUTS[name], (BF16_KIND,), native=False, dtype="bf16"))
        latents[name] = {side: saved(recent_comfyui_server, result, f"{BF16_KIND}_{side}") for side in SIDES[1:]}
    return latents


@pytest.mark.parametrize("side", SIDES[1:])
def test_wan22_fun_camera_in_bf16_is_close_to_fp32_and_tp2_cfg2_to_one_rank(bf16_latents, layout_latents, side):
    fp32 = layout_latents["world1"][f"{BF16_KIND}_{side}"]
    world1 = bf16_latents["world1"][side]
    assert MIN_HALF_ERROR < relative_error(world1, fp32) <= DTYPE_TOLERANCE["bf16"]
    assert relative_error(bf16_latents["tp2_cfg2"][side], world1) <= LAYOUT_TOLERANCE["bf16"]
