"""The Wan 2.2 two-expert example (``workflows/api/wan22_two_experts.json``) in a real 2024 ComfyUI server.

The example chains two WanMesh samplers the way native Wan 2.2 workflows chain two KSamplerAdvanced nodes
(the high-noise expert for the first steps, the low-noise expert for the rest, no noise added by the second).
Its frames must equal those of one sampler given both experts and the boundary where the schedule's timesteps
cross 0.875, and the server log must name the steps each expert ran.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
from comfyui_server import ComfyUIServer
from PIL import Image
from test_comfyui_server import PIXEL_TOLERANCE, largest_pixel_difference, run_successfully, saved_images
from workflow_graph import load_workflow

WORKFLOW = "api/wan22_two_experts.json"


def samplers(prompt: dict[str, Any]) -> tuple[str, str]:
    """(first, second) sampler node ids: the second takes the first's latent."""
    ids = [node_id for node_id, node in prompt.items() if node["class_type"] == "WanMeshSampler"]
    second = next(node_id for node_id in ids if prompt[node_id]["inputs"]["latent_image"][0] in ids)
    return next(node_id for node_id in ids if node_id != second), second


def save_as_images(prompt: dict[str, Any], prefix: str) -> tuple[dict[str, Any], str]:
    """The prompt with its video node replaced by SaveImage (lossless PNG frames to compare)."""
    changed = copy.deepcopy(prompt)
    node_id = next(i for i, node in changed.items() if node["class_type"] == "WanMeshSaveVideo")
    changed[node_id] = {"class_type": "SaveImage",
                        "inputs": {"images": changed[node_id]["inputs"]["images"], "filename_prefix": prefix}}
    return changed, node_id


def one_sampler_with_both_experts(prompt: dict[str, Any]) -> dict[str, Any]:
    """The chained pair folded into the first sampler: model_low_noise, cfg_low_noise, run to the end."""
    first, second = samplers(prompt)
    merged = copy.deepcopy(prompt)
    low_inputs = merged.pop(second)["inputs"]
    merged[first]["inputs"].update(model_low_noise=low_inputs["model"], cfg_low_noise=low_inputs["cfg"],
                                   end_step=10000, boundary=0.875)
    for node in merged.values():
        for name, value in node["inputs"].items():
            if value == [second, 0]:
                node["inputs"][name] = [first, 0]
    return merged


def frames_of(server: ComfyUIServer, prompt: dict[str, Any], prefix: str) -> np.ndarray:
    prompt, save_node_id = save_as_images(prompt, prefix)
    paths = saved_images(server, run_successfully(server, prompt), save_node_id)
    return np.stack([np.asarray(Image.open(path).convert("RGB")) for path in paths])


def test_example_chains_two_experts_like_native_wan22_workflows() -> None:
    prompt = load_workflow(WORKFLOW)
    first, second = samplers(prompt)
    loaders = {prompt[node_id]["inputs"]["model"][0] for node_id in (first, second)}
    assert len(loaders) == 2, "each sampler must take its own expert"
    a, b = prompt[first]["inputs"], prompt[second]["inputs"]
    assert (a["start_step"], a["add_noise"], b["start_step"], b["end_step"], b["add_noise"]) == (0, True, a["end_step"], 10000, False)
    assert a["sampler_name"] == b["sampler_name"] == "euler", "euler makes the chain exact (unipc restarts its history)"


def test_chained_workflow_equals_one_two_expert_sampler(comfyui_server: ComfyUIServer) -> None:
    prompt = load_workflow(WORKFLOW)
    chained = frames_of(comfyui_server, prompt, "wanmesh_two_experts_chained")
    merged = frames_of(comfyui_server, one_sampler_with_both_experts(prompt), "wanmesh_two_experts_merged")
    assert largest_pixel_difference(chained, merged) <= PIXEL_TOLERANCE
    log = comfyui_server.log()
    assert "WanMesh sampler: high-noise expert: steps 0-1, low-noise expert: steps 2-5" in log, log[-3000:]
    assert "WanMesh sampler: model: steps 0-1" in log and "WanMesh sampler: model: steps 2-5" in log


def test_example_writes_its_video(comfyui_server: ComfyUIServer) -> None:
    prompt = load_workflow(WORKFLOW)
    save_id = next(i for i, node in prompt.items() if node["class_type"] == "WanMeshSaveVideo")
    assert prompt[save_id]["inputs"]["fps"] == 16.0
    result = run_successfully(comfyui_server, prompt)
    videos = result.outputs[save_id]["images"]
    paths = [comfyui_server.output_dir / video["subfolder"] / video["filename"] for video in videos]
    assert len(paths) == 1 and paths[0].suffix == ".mp4" and paths[0].stat().st_size > 0
