"""The pack inside a recent ComfyUI (0.33, the version users run), beside its native Wan nodes.

The same checks as on the 2024 copy where they matter (nodes registered, the t2v example runs), plus the
interchange with native nodes that only a recent ComfyUI has: its own ``VAELoader`` reads the tiny Wan VAE
file and its ``VAEDecode`` decodes a WanMesh latent into the frames WanMesh's decoder makes of it; its
``WanVaceToVideo`` and ``TrimVideoLatent`` and WanMesh's VACE encode and trim are interchangeable
(``workflows/native/``: the same VACE video made both ways). One server serves the whole module
(``recent_comfyui_server``); it checks at teardown that no worker outlives it.
"""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import random
import re
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch
from comfyui_server import ComfyUIServer, PromptResult
from safetensors.torch import load_file
from test_comfyui_server import (PIXEL_TOLERANCE, assert_pack_imported_cleanly, assert_video,
                                 assert_video_shows_frames, largest_pixel_difference, read_png_frames,
                                 run_successfully, save_node_id_of, saved_images, saved_video, with_png_frames)
from workflow_graph import (MAX_SEED, UPLOAD_WIDGET_NAME, api_widget_names, is_link, load_workflow, node_of_type,
                            widget_names_from_object_info, with_inputs)

RECENT_VERSION = "0.33.0"
NATIVE_NODE_IDS = ("WanVaceToVideo", "TrimVideoLatent", "VAELoader", "VAEDecode", "SaveVideo")
# Fresh ids for the native nodes added to the t2v example (its own ids are small numbers).
NATIVE_VAE_LOADER_ID, NATIVE_DECODE_ID, NATIVE_SAVE_ID = "101", "102", "103"
# The same VACE video made with native WanVaceToVideo / TrimVideoLatent / VAELoader / VAEDecode and with WanMesh's
# VACE encode / trim / VAE nodes, from the same inputs and seed.
NATIVE_VACE_WORKFLOWS = ("native/api/vace_native.json", "native/api/vace_wanmesh.json")
SAVE_LATENT_ID = "201"  # a SaveLatent added after the trim
# Two encodes of the same inputs differ by float rounding only (two VAE implementations); sampling keeps that small.
LATENT_TOLERANCE = 1e-4
VAE_STRIDE, LATENT_CHANNELS = 8, 16
ENCODE_OUTPUT_TRIM_LATENT = 3  # both encodes output positive, negative, latent, trim_latent


def wanmesh_node_ids() -> set[str]:
    """The node ids the pack registers, read from its ComfyUI entry point now (the pack's layout may change)."""
    return set(importlib.import_module("wanmesh").NODE_CLASS_MAPPINGS)


def node_id_of(prompt: dict[str, Any], class_type: str) -> str:
    (node_id,) = [node_id for node_id, node in prompt.items() if node["class_type"] == class_type]
    return node_id


def with_native_decode(prompt: dict[str, Any]) -> dict[str, Any]:
    """The t2v example plus native ``VAELoader`` -> ``VAEDecode`` -> ``SaveImage`` on the WanMesh sampler's latent.

    The native loader reads the same VAE file as the WanMesh VAE loader; both decodes save their own frames.
    """
    changed = copy.deepcopy(prompt)
    vae_file = node_of_type(changed, "WanMeshVAELoader")["inputs"]["vae_name"]
    sampler_id = node_id_of(changed, "WanMeshSampler")
    node_of_type(changed, "SaveImage")["inputs"]["filename_prefix"] = "wanmesh_decode"
    changed[NATIVE_VAE_LOADER_ID] = {"class_type": "VAELoader", "inputs": {"vae_name": vae_file}}
    changed[NATIVE_DECODE_ID] = {"class_type": "VAEDecode",
                                 "inputs": {"samples": [sampler_id, 0], "vae": [NATIVE_VAE_LOADER_ID, 0]}}
    changed[NATIVE_SAVE_ID] = {"class_type": "SaveImage",
                               "inputs": {"images": [NATIVE_DECODE_ID, 0], "filename_prefix": "native_decode"}}
    return changed


def test_object_info_lists_wanmesh_and_native_nodes(recent_comfyui_server: ComfyUIServer) -> None:
    info = recent_comfyui_server.get_json("/object_info")
    expected = wanmesh_node_ids()
    assert expected, "the pack registers no node"
    missing = sorted((expected | set(NATIVE_NODE_IDS)) - info.keys())
    assert not missing, f"nodes missing from the recent ComfyUI's /object_info: {missing}"


def test_pack_imports_without_failures(recent_comfyui_server: ComfyUIServer) -> None:
    assert_pack_imported_cleanly(recent_comfyui_server)


def test_frontend_is_the_pinned_pip_package(recent_comfyui_server: ComfyUIServer, recent_comfyui_dir: Path) -> None:
    """The UI is served from the installed ``comfyui-frontend-package`` at the version ComfyUI pins, not fetched."""
    requirements = (recent_comfyui_dir / "requirements.txt").read_text(encoding="utf-8")
    (pinned,) = re.findall(r"^comfyui-frontend-package==(\S+)$", requirements, flags=re.MULTILINE)
    assert importlib.metadata.version("comfyui-frontend-package") == pinned
    system = recent_comfyui_server.get_json("/system_stats")["system"]
    assert (system["comfyui_version"], system["required_frontend_version"]) == (RECENT_VERSION, pinned), system
    log = recent_comfyui_server.log()
    web_roots = [line for line in log.splitlines() if "web root:" in line]
    assert web_roots and all("comfyui_frontend_package" in line for line in web_roots), web_roots
    with urllib.request.urlopen(recent_comfyui_server.base_url + "/", timeout=30.0) as response:
        assert "<html" in response.read().decode("utf-8", errors="replace").lower()


def test_t2v_workflow_writes_an_mp4_and_one_png_per_frame(recent_comfyui_server: ComfyUIServer,
                                                          t2v_prompt: dict[str, Any]) -> None:
    latent = node_of_type(t2v_prompt, "WanMeshEmptyLatent")["inputs"]
    save_node_id = node_id_of(t2v_prompt, "SaveImage")
    prefix = t2v_prompt[save_node_id]["inputs"]["filename_prefix"]

    result = run_successfully(recent_comfyui_server, t2v_prompt)

    paths = saved_images(recent_comfyui_server, result, save_node_id)
    assert len(paths) == latent["length"] * latent["batch_size"]
    assert all(path.name.startswith(prefix) and path.suffix == ".png" for path in paths), paths
    frames = read_png_frames(paths)
    assert frames.shape[1:3] == (latent["height"], latent["width"]), frames.shape
    assert frames.reshape(-1, 3).std(axis=0).max() > 0, "the frames are a single colour"
    video = assert_video(saved_video(recent_comfyui_server, result, t2v_prompt), len(paths), latent["width"],
                         latent["height"])
    assert_video_shows_frames(video, frames)


def test_native_vae_decodes_wanmesh_latent_like_wanmesh(recent_comfyui_server: ComfyUIServer,
                                                        t2v_prompt: dict[str, Any]) -> None:
    """Native ``VAELoader`` reads the tiny VAE file and native ``VAEDecode`` accepts WanMesh's raw latents.

    ComfyUI's own Wan VAE code is the independent reference: decoding one sampled latent with it and with
    WanMesh's decoder must give the same frames, up to float differences and 8-bit rounding.
    """
    wanmesh_save_id = node_id_of(t2v_prompt, "SaveImage")
    prompt = with_native_decode(t2v_prompt)
    latent = node_of_type(prompt, "WanMeshEmptyLatent")["inputs"]

    result = run_successfully(recent_comfyui_server, prompt)

    native = read_png_frames(saved_images(recent_comfyui_server, result, NATIVE_SAVE_ID))
    wanmesh = read_png_frames(saved_images(recent_comfyui_server, result, wanmesh_save_id))
    assert native.shape == (latent["length"] * latent["batch_size"], latent["height"], latent["width"], 3)
    # The comparison means something only if the frames are far from flat: spread well beyond the tolerance.
    spread = int(native.max()) - int(native.min())
    assert spread > 8 * PIXEL_TOLERANCE, f"the native decode spans only {spread}/255"
    difference = largest_pixel_difference(native, wanmesh)
    assert difference <= PIXEL_TOLERANCE, f"native and WanMesh decodes of one latent differ by up to {difference}/255"


def with_saved_latent(prompt: dict[str, Any], seed: int, prefix: str) -> dict[str, Any]:
    """The prompt with ``seed``, a ``SaveLatent`` of the latent its (one) VAE decode takes (the trimmed latent) and
    a SaveImage of its frames (``with_png_frames``)."""
    changed = with_png_frames(with_inputs(prompt, "WanMeshSampler", seed=seed), prefix.replace("/", "_"))
    (decode,) = [node for node in changed.values() if node["class_type"] in ("VAEDecode", "WanMeshVAEDecode")]
    changed[SAVE_LATENT_ID] = {"class_type": "SaveLatent",
                               "inputs": {"samples": decode["inputs"]["samples"], "filename_prefix": prefix}}
    return changed


def saved_latent(server: ComfyUIServer, result: PromptResult) -> torch.Tensor:
    """The tensor of the one ``.latent`` file (safetensors) the added SaveLatent wrote."""
    (item,) = result.outputs[SAVE_LATENT_ID]["latents"]
    path = server.output_dir / item["subfolder"] / item["filename"]
    return load_file(str(path))["latent_tensor"]


def run_twin(server: ComfyUIServer, prompt: dict[str, Any]) -> tuple[torch.Tensor, np.ndarray]:
    """Run a twin; return its trimmed latent and its decoded frames."""
    result = run_successfully(server, prompt)
    return saved_latent(server, result), read_png_frames(saved_images(server, result, save_node_id_of(prompt)))


def test_t2v_at_a_size_that_is_not_a_multiple_of_16_decodes_like_native(recent_comfyui_server: ComfyUIServer,
                                                                       t2v_prompt: dict[str, Any]) -> None:
    """72x40 px (a 5x9 latent, odd both ways) samples through the nodes, as native Wan does (the transformer pads to its
    patches), and native ``VAEDecode`` of that latent gives WanMesh's frames."""
    wanmesh_save_id = node_id_of(t2v_prompt, "SaveImage")
    prompt = with_native_decode(t2v_prompt)
    latent = node_of_type(prompt, "WanMeshEmptyLatent")["inputs"]
    latent.update(width=72, height=40)

    result = run_successfully(recent_comfyui_server, prompt)

    native = read_png_frames(saved_images(recent_comfyui_server, result, NATIVE_SAVE_ID))
    wanmesh = read_png_frames(saved_images(recent_comfyui_server, result, wanmesh_save_id))
    assert native.shape == (latent["length"] * latent["batch_size"], 40, 72, 3)
    assert int(native.max()) - int(native.min()) > 8 * PIXEL_TOLERANCE
    difference = largest_pixel_difference(native, wanmesh)
    assert difference <= PIXEL_TOLERANCE, f"native and WanMesh decodes of one latent differ by up to {difference}/255"


def test_native_vace_workflows_match_node_definitions(recent_comfyui_server: ComfyUIServer) -> None:
    """Widget inputs in declared order, no undeclared inputs (as ``test_api_workflow_matches_node_definitions``)."""
    info = recent_comfyui_server.get_json("/object_info")
    for relative_path in NATIVE_VACE_WORKFLOWS:
        for node_id, node in load_workflow(relative_path).items():
            node_info = info[node["class_type"]]
            linked = {name for name, value in node["inputs"].items() if is_link(value)}
            # Today's frontend keeps LoadImage's upload button out of the prompt; widgets fed by links have no value.
            widgets = [name for name in widget_names_from_object_info(node_info)
                       if name not in linked and name != UPLOAD_WIDGET_NAME]
            assert api_widget_names(node) == widgets, f"{relative_path} node {node_id}"
            declared = {**node_info["input"]["required"], **node_info["input"].get("optional", {})}
            unknown = sorted(set(node["inputs"]) - set(declared))
            assert not unknown, f"{relative_path} node {node_id} ({node['class_type']}) has undeclared inputs {unknown}"


def test_native_vace_encode_and_wanmesh_vace_encode_are_interchangeable(
        recent_comfyui_server: ComfyUIServer) -> None:
    """Native WanVaceToVideo + TrimVideoLatent + VAEDecode and WanMesh's VACE encode + trim + decode, on the same
    reference image, control video, mask and seed, give the same trimmed latent (1e-4) and frames (8-bit rounding).

    ComfyUI's own VACE conditioning code and VAE are the independent reference. The comparison is shown to be
    sensitive: the WanMesh twin with half the VACE strength lands far outside the tolerance.
    """
    native_prompt, wanmesh_prompt = (load_workflow(path) for path in NATIVE_VACE_WORKFLOWS)
    native_encode = node_of_type(native_prompt, "WanVaceToVideo")["inputs"]
    wanmesh_encode = node_of_type(wanmesh_prompt, "WanMeshVaceEncode")["inputs"]
    size_keys = ("width", "height", "length", "batch_size", "strength")
    assert [native_encode[key] for key in size_keys] == [wanmesh_encode[key] for key in size_keys]
    for prompt, encode_type, trim_type in ((native_prompt, "WanVaceToVideo", "TrimVideoLatent"),
                                           (wanmesh_prompt, "WanMeshVaceEncode", "WanMeshTrimLatent")):
        trim_amount = node_of_type(prompt, trim_type)["inputs"]["trim_amount"]
        assert trim_amount == [node_id_of(prompt, encode_type), ENCODE_OUTPUT_TRIM_LATENT], trim_amount
    seed = random.randint(0, MAX_SEED)

    native_latent, native_frames = run_twin(recent_comfyui_server,
                                            with_saved_latent(native_prompt, seed, "latents/vace_native"))
    wanmesh_latent, wanmesh_frames = run_twin(recent_comfyui_server,
                                              with_saved_latent(wanmesh_prompt, seed, "latents/vace_wanmesh"))
    weaker_prompt = with_inputs(wanmesh_prompt, "WanMeshVaceEncode", strength=wanmesh_encode["strength"] / 2)
    weaker_latent, _ = run_twin(recent_comfyui_server, with_saved_latent(weaker_prompt, seed, "latents/vace_weaker"))

    width, height, length, batch = (native_encode[key] for key in ("width", "height", "length", "batch_size"))
    # The reference frame's latent is trimmed: only the video's (length - 1) / 4 + 1 latent frames remain.
    latent_shape = (batch, LATENT_CHANNELS, (length - 1) // 4 + 1, height // VAE_STRIDE, width // VAE_STRIDE)
    assert tuple(native_latent.shape) == latent_shape, native_latent.shape
    assert tuple(wanmesh_latent.shape) == latent_shape, wanmesh_latent.shape
    latent_difference = (native_latent.float() - wanmesh_latent.float()).abs().max().item()
    assert latent_difference <= LATENT_TOLERANCE, f"the trimmed latents differ by up to {latent_difference:.3g}"
    strength_difference = (weaker_latent.float() - wanmesh_latent.float()).abs().max().item()
    assert strength_difference > 100 * LATENT_TOLERANCE, (
        f"half the VACE strength changed the latent by only {strength_difference:.3g}: the comparison proves nothing")

    assert native_frames.shape == (length * batch, height, width, 3), native_frames.shape
    spread = int(native_frames.max()) - int(native_frames.min())
    assert spread > 8 * PIXEL_TOLERANCE, f"the native decode spans only {spread}/255"
    frame_difference = largest_pixel_difference(native_frames, wanmesh_frames)
    assert frame_difference <= PIXEL_TOLERANCE, f"native and WanMesh frames differ by up to {frame_difference}/255"
