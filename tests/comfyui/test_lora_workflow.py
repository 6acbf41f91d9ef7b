"""The ``t2v_lora`` example in a real 2024 ComfyUI server: two chained WanMesh LoRA loaders on a tp 2 pool write an
MP4 whose frames differ from the run without LoRAs, and LoRAs at strength 0 give exactly the run without them."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from comfyui_server import ComfyUIServer
from test_comfyui_server import run_successfully
from workflow_graph import load_workflow, node_of_type

from wanmesh.parallel import read_video

LORA_LOADER = "WanMeshLoraLoader"


def _save_id(prompt: dict[str, Any]) -> str:
    return next(node_id for node_id, node in prompt.items() if node["class_type"] == "WanMeshSaveVideo")


def _loader_ids(prompt: dict[str, Any]) -> list[str]:
    return [node_id for node_id, node in prompt.items() if node["class_type"] == LORA_LOADER]


def _run_video(server: ComfyUIServer, prompt: dict[str, Any], prefix: str) -> torch.Tensor:
    prompt = copy.deepcopy(prompt)
    prompt[_save_id(prompt)]["inputs"]["filename_prefix"] = prefix
    result = run_successfully(server, prompt)
    (item,) = result.outputs[_save_id(prompt)]["images"]
    path = server.output_dir / item["subfolder"] / item["filename"]
    assert path.suffix == ".mp4" and path.stat().st_size > 0, path
    return read_video(path)


def _with_strengths(prompt: dict[str, Any], strength: float) -> dict[str, Any]:
    changed = copy.deepcopy(prompt)
    for node_id in _loader_ids(changed):
        changed[node_id]["inputs"]["strength"] = strength
    return changed


def _without_loras(prompt: dict[str, Any]) -> dict[str, Any]:
    """The same graph with the sampler fed straight from the model loader."""
    changed = copy.deepcopy(prompt)
    loader = next(node_id for node_id, node in changed.items() if node["class_type"] == "WanMeshModelLoader")
    node_of_type(changed, "WanMeshSampler")["inputs"]["model"] = [loader, 0]
    for node_id in _loader_ids(changed):
        del changed[node_id]
    return changed


def test_t2v_lora_workflow_applies_its_loras_on_the_mesh(comfyui_server: ComfyUIServer) -> None:
    prompt = load_workflow("api/t2v_lora.json")
    pool = node_of_type(prompt, "WanMeshPool")["inputs"]
    assert (pool["world"], pool["tp"]) == (2, 2), pool
    loaders = _loader_ids(prompt)
    assert len(loaders) == 2 and prompt[loaders[1]]["inputs"]["model"] == [loaders[0], 0], "the loaders must chain"
    assert node_of_type(prompt, "WanMeshSaveVideo")["inputs"]["fps"] == 16

    with_loras = _run_video(comfyui_server, prompt, "wanmesh_lora")
    plain = _run_video(comfyui_server, _without_loras(prompt), "wanmesh_no_lora")
    zero = _run_video(comfyui_server, _with_strengths(prompt, 0.0), "wanmesh_lora_zero")

    latent = node_of_type(prompt, "WanMeshEmptyLatent")["inputs"]
    assert with_loras.shape == (latent["length"], latent["height"], latent["width"], 3)
    assert torch.equal(zero, plain), "LoRAs at strength 0 changed the video"
    assert float((with_loras - plain).abs().max()) * 255 > 8, "the LoRAs did not change the video"
    assert np.isfinite(with_loras.numpy()).all()
