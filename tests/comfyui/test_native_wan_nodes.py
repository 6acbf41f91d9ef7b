"""Every native Wan node of ComfyUI 0.33 on the WanMesh MODEL: it gives native's numbers or stops the prompt.

``VERDICTS`` holds each node of ComfyUI's Wan node modules (``nodes_wan.py``, ``nodes_wanmove.py``,
``nodes_scail.py``, ``nodes_wandancer.py``, ``nodes_bernini.py``) with what it does on the pool and the test that
proves it; a node that ComfyUI adds and the table lacks fails the walk, so none is silently ignored. The nodes
proven here:

* WanMove (``GenerateTracks`` -> ``WanMoveTrackToVideo``, whose tracks change the positive's image latents only)
  on a tiny image-to-video file: KSampler on the WanMesh MODEL and the WanMesh Sampler within 1e-4 of native
  ``UNETLoader`` + KSampler, and tp 2 x CFG parallel 2 equal to one rank (the two guidance passes carry different
  image latents, so each CFG rank conditions on its own).
* Nodes of models WanMesh does not run yet (Animate-2's ``WanAnimate2ToVideo`` on an image-to-video file, whose
  pose branch ComfyUI's image-to-video model would drop; ``BerniniConditioning``'s in-context latents): the prompt
  stops in one line naming the node, through KSampler on the WanMesh MODEL and through the WanMesh Sampler, while
  native ``UNETLoader`` + KSampler samples the same graph (so the refusal is of the node, not of a broken graph),
  and the server goes on.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from comfyui_server import ComfyUIServer, PromptResult
from test_comfyui_server import run_successfully
from test_image_to_video import ksampler, wanmesh_sampler
from test_native_sampling import (TOLERANCE, largest_difference, pool_and_prompts, save_latent, saved)

I2V_FILE, T2V_FILE = "wan_tiny_i2v.safetensors", "wan_native_t2v.safetensors"
WIDTH, HEIGHT, LENGTH = 48, 32, 9
LAYOUTS = {"world1": dict(devices="cpu:1", world=1), "tp2_cfg2": dict(devices="cpu:4", world=4, tp=2, cfg_parallel=True)}
SIDES = ("model", "sampler")  # KSampler on the WanMesh MODEL, the WanMesh Sampler

NODE_MODULES = ("nodes_wan.py", "nodes_wanmove.py", "nodes_scail.py", "nodes_wandancer.py", "nodes_bernini.py")
PARITY, REFUSED, NO_MODEL = "equals native", "refused in one line", "no model input (works as native)"
# node -> (verdict, the test that proves it)
VERDICTS = {
    "WanImageToVideo": (PARITY, "tests/comfyui/test_image_to_video.py"),
    "WanFirstLastFrameToVideo": (PARITY, "tests/comfyui/test_image_to_video.py"),
    "WanFunInpaintToVideo": (PARITY, "tests/comfyui/test_image_to_video.py"),
    "WanFunControlToVideo": (PARITY, "tests/comfyui/test_image_to_video.py"),
    "Wan22FunControlToVideo": (PARITY, "tests/comfyui/test_fun22_control.py"),
    "WanVaceToVideo": (PARITY, "tests/comfyui/test_native_sampling.py"),
    "TrimVideoLatent": (NO_MODEL, "tests/comfyui/test_recent_comfyui.py"),
    "WanCameraImageToVideo": (PARITY, "tests/comfyui/test_fun_camera.py"),
    "WanPhantomSubjectToVideo": (PARITY, "tests/comfyui/test_phantom_and_tracks.py"),
    "WanTrackToVideo": (PARITY, "tests/comfyui/test_phantom_and_tracks.py"),
    "WanAnimateToVideo": (PARITY, "tests/comfyui/test_animate.py"),
    "Wan22ImageToVideoLatent": (PARITY, "tests/comfyui/test_native_ti2v.py"),
    "WanMoveTrackToVideo": (PARITY, "tests/comfyui/test_native_wan_nodes.py"),
    "GenerateTracks": (NO_MODEL, "tests/comfyui/test_native_wan_nodes.py"),
    "WanMoveTracksFromCoords": (NO_MODEL, "its TRACKS feed WanMoveTrackToVideo"),
    "WanMoveConcatTrack": (NO_MODEL, "its TRACKS feed WanMoveTrackToVideo"),
    "WanMoveVisualizeTracks": (NO_MODEL, "an image of the tracks"),
    "WanAnimate2ToVideo": (REFUSED, "tests/comfyui/test_native_wan_nodes.py"),
    "WanAnimate2Cache": (NO_MODEL, "caches Animate-2's pose branch, which is refused"),
    "BerniniConditioning": (REFUSED, "tests/comfyui/test_native_wan_nodes.py"),
    "WanSoundImageToVideo": (REFUSED, "nodes/bridge/conditioning_keys.py"),
    "WanSoundImageToVideoExtend": (REFUSED, "nodes/bridge/conditioning_keys.py"),
    "WanHuMoImageToVideo": (PARITY, "tests/comfyui/test_humo_workflow.py"),
    "WanSCAILToVideo": (REFUSED, "nodes/bridge/conditioning_keys.py"),
    "SCAIL2ColoredMask": (NO_MODEL, "a mask image for WanSCAILToVideo"),
    "WanDancerVideo": (REFUSED, "nodes/bridge/conditioning_keys.py"),
    "WanDancerEncodeAudio": (NO_MODEL, "audio features for WanDancerVideo"),
    "WanDancerPadKeyframes": (NO_MODEL, "images for WanDancerVideo"),
    "WanDancerPadKeyframesList": (NO_MODEL, "images for WanDancerVideo"),
    "WanInfiniteTalkToVideo": (REFUSED, "nodes/bridge/pool_patches.py (its model patch)"),
}
# the conditioning nodes WanMesh refuses, on the file each samples: (node, file, its inputs, what the refusal names)
REFUSALS = {
    "animate2": ("WanAnimate2ToVideo", I2V_FILE, {"reference_image": ["start", 0], "pose_video": ["pose", 0],
                                                  "clip_vision_output": ["clip_start", 0], "video_frame_offset": 0,
                                                  "pose_strength": 1.0, "pose_start_percent": 0.0,
                                                  "pose_end_percent": 1.0, "reference_image_strength": 1.0},
                 ("WanAnimate2ToVideo", "Animate-2")),
    "bernini": ("BerniniConditioning", T2V_FILE, {"source_video": ["pose", 0], "ref_max_size": 64},
                ("BerniniConditioning", "context_latents")),
}


def node_ids_of(comfy_dir: Path) -> set[str]:
    return {node for module in NODE_MODULES
            for node in re.findall(r'node_id="(\w+)"', (comfy_dir / "comfy_extras" / module).read_text("utf-8"))}


def test_the_walk_covers_every_native_wan_node(recent_comfyui_dir: Path) -> None:
    found = node_ids_of(recent_comfyui_dir)
    assert "WanAnimate2ToVideo" in found and "WanMoveTrackToVideo" in found, "the reading of ComfyUI's nodes broke"
    assert found == set(VERDICTS), f"not walked: {sorted(found - set(VERDICTS))}; gone: {sorted(set(VERDICTS) - found)}"
    root = Path(__file__).resolve().parents[2]
    for node, (_, proof) in VERDICTS.items():
        path = root / proof.split()[0]
        if path.suffix == ".py" and path != Path(__file__).resolve():
            assert node in path.read_text("utf-8"), f"{proof} never names {node}"


DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "existing-workflow.md"


def test_the_docs_table_is_the_walks() -> None:
    """docs/existing-workflow.md's table of the native Wan nodes gives each node the verdict the walk holds."""
    page = DOCS_PAGE.read_text("utf-8")
    section = page.split("## The native Wan nodes of ComfyUI 0.33", 1)[1].split("\n## ", 1)[0]
    table = {node: verdict.strip() for node, verdict in re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, re.M)}
    assert table == {node: verdict for node, (verdict, _) in VERDICTS.items()}


def shared_inputs(layout: dict[str, Any]) -> dict[str, Any]:
    return {
        **pool_and_prompts(layout),
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_tiny_vae.safetensors"}},
        "start": {"class_type": "LoadImage", "inputs": {"image": "ref_circle.png"}},
        "texture": {"class_type": "LoadImage", "inputs": {"image": "ref_texture.png"}},
        "pose": {"class_type": "RepeatImageBatch", "inputs": {"image": ["texture", 0], "amount": LENGTH}},
        "clip": {"class_type": "WanMeshCLIPVisionLoader", "inputs": {"clip_name": "clip_vision_tiny.safetensors"}},
        "clip_start": {"class_type": "WanMeshCLIPVisionEncode",
                       "inputs": {"clip_vision": ["clip", 0], "image": ["start", 0], "crop": "center"}},
    }


def models(model_file: str, native: bool) -> dict[str, Any]:
    prompt = {"wm": {"class_type": "WanMeshModelLoader",
                     "inputs": {"model_name": model_file, "dtype": "fp32", "pool": ["pool", 0]}},
              "wmodel": {"class_type": "WanMeshNativeModel", "inputs": {"model": ["wm", 0]}}}
    if native:
        prompt["unet"] = {"class_type": "UNETLoader", "inputs": {"unet_name": model_file, "weight_dtype": "default"}}
    return prompt


def size() -> dict[str, Any]:
    return {"positive": ["pos", 0], "negative": ["neg", 0], "vae": ["vae", 0], "width": WIDTH, "height": HEIGHT,
            "length": LENGTH, "batch_size": 1}


# Native WanMoveTrackToVideo shuffles the tracks with torch's unseeded global generator, so where two tracks meet in
# one latent cell, which one's feature lands there changes from run to run (natively too). Spread 12 px apart (more
# than an 8 px cell's diagonal), the tracks never share a cell, and separate runs (one per layout) are comparable.
TRACK_SPREAD = 0.3


def wanmove_prompt(layout: dict[str, Any], native: bool) -> dict[str, Any]:
    """Nodes ``model`` / ``sampler`` (and ``native``) save each side's latent of the WanMove graph."""
    prompt = {**shared_inputs(layout), **models(I2V_FILE, native),
              "tracks": {"class_type": "GenerateTracks", "inputs": {
                  "width": WIDTH, "height": HEIGHT, "start_x": 0.2, "start_y": 0.3, "end_x": 0.8, "end_y": 0.6,
                  "num_frames": LENGTH, "num_tracks": 3, "track_spread": TRACK_SPREAD, "bezier": True, "mid_x": 0.5,
                  "mid_y": 0.1, "interpolation": "ease_in_out"}},
              "cond": {"class_type": "WanMoveTrackToVideo", "inputs": {
                  **size(), "tracks": ["tracks", 0], "strength": 1.0, "start_image": ["start", 0],
                  "clip_vision_output": ["clip_start", 0]}}}
    samplers = {"model": ksampler("wmodel", "cond"), "sampler": wanmesh_sampler("wm", "cond")}
    if native:
        samplers["native"] = ksampler("unet", "cond")
    for side, node in samplers.items():
        prompt[f"{side}_k"] = node
        prompt[side] = save_latent(f"{side}_k", f"wanmove_{side}")
    return prompt


@pytest.fixture(scope="module")
def wanmove_latents(recent_comfyui_server: ComfyUIServer) -> dict[tuple[str, str], torch.Tensor]:
    found = {}
    for name, layout in LAYOUTS.items():
        native = name == "world1"
        result = run_successfully(recent_comfyui_server, wanmove_prompt(layout, native))
        for side in SIDES + (("native",) if native else ()):
            found[side, name] = saved(recent_comfyui_server, result, side)
    return found


@pytest.mark.parametrize("side", SIDES)
def test_wanmove_on_the_pool_equals_native(wanmove_latents, side: str) -> None:
    native = wanmove_latents["native", "world1"]
    assert native.abs().max().item() > 0.1, "the native latent is flat: the comparison proves nothing"
    difference = largest_difference(native, wanmove_latents[side, "world1"])
    assert difference <= TOLERANCE, f"WanMove, WanMesh {side}: {difference:.3g} from native"


@pytest.mark.parametrize("side", SIDES)
def test_wanmove_under_tp_and_cfg_parallel_equals_one_rank(wanmove_latents, side: str) -> None:
    difference = largest_difference(wanmove_latents[side, "tp2_cfg2"], wanmove_latents[side, "world1"])
    assert difference <= TOLERANCE, f"WanMove, WanMesh {side}, tp 2 x cfg 2: {difference:.3g} from world 1"


def refusal_prompt(case: str, side: str) -> dict[str, Any]:
    """The node's conditioning sampled by native KSampler (node ``native``) and by one WanMesh side."""
    node, model_file, inputs, _ = REFUSALS[case]
    prompt = {**shared_inputs(LAYOUTS["world1"]), **models(model_file, native=True),
              "cond": {"class_type": node, "inputs": {**size(), **inputs}},
              "native_k": ksampler("unet", "cond"), "native": save_latent("native_k", f"refusal_{case}_native")}
    prompt["wanmesh_k"] = ksampler("wmodel", "cond") if side == "model" else wanmesh_sampler("wm", "cond")
    prompt["wanmesh"] = save_latent("wanmesh_k", f"refusal_{case}_{side}")
    return prompt


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("case", REFUSALS)
def test_a_node_of_a_model_wanmesh_does_not_run_stops_the_prompt_in_one_line(
        recent_comfyui_server: ComfyUIServer, case: str, side: str) -> None:
    prompt = refusal_prompt(case, side)
    result = recent_comfyui_server.run(prompt, 300)
    assert isinstance(result, PromptResult) and result.status == "error", f"{case} was sampled on the {side} side"
    (error,) = [data for event, data in result.messages if event == "execution_error"]
    message = error["exception_message"].strip()
    assert all(word in message for word in REFUSALS[case][3]), message
    assert "\n" not in message and len(message) <= 400, message
    prompt.pop("wanmesh"), prompt.pop("wanmesh_k")
    native = saved(recent_comfyui_server, run_successfully(recent_comfyui_server, prompt), "native")
    assert native.abs().max().item() > 0.1, "native did not sample the node's graph"
