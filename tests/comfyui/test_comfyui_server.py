"""The pack inside a real ComfyUI server: node registration, a text-to-video prompt, bad input."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from comfyui_server import ComfyUIServer, PromptResult, RejectedPrompt
from PIL import Image
from prepare_comfyui import PACK_FOLDER_NAME
from workflow_graph import (WORKFLOWS_DIR, api_widget_names, load_workflow, node_of_type, widget_names_from_object_info,
                            with_fresh_seed)

CORE_NODE_IDS = ("WanMeshModelLoader", "WanMeshVAELoader", "WanMeshTextEncoderLoader", "WanMeshTextEncode",
                 "WanMeshEmptyLatent", "WanMeshSampler", "WanMeshVAEDecode", "WanMeshVAEEncode")
PROMPT_TIMEOUT_S = 420.0
API_WORKFLOWS = sorted(path.name for path in (WORKFLOWS_DIR / "api").glob("*.json"))


def expected_node_ids() -> set[str]:
    """The core nodes plus every WanMesh node an example workflow uses."""
    used = {node["class_type"] for name in API_WORKFLOWS for node in load_workflow(f"api/{name}").values()}
    return set(CORE_NODE_IDS) | {class_type for class_type in used if class_type.startswith("WanMesh")}


def run_successfully(server: ComfyUIServer, prompt: dict[str, Any]) -> PromptResult:
    result = server.run(prompt, PROMPT_TIMEOUT_S)
    assert not isinstance(result, RejectedPrompt), f"prompt rejected:\n{result.error_text()}"
    assert result.status == "success", f"prompt failed:\n{result.error_text()}\n--- server log ---\n{server.log()}"
    return result


def saved_images(server: ComfyUIServer, result: PromptResult, save_node_id: str) -> list[Path]:
    """The files a SaveImage node reported in ``/history``, checked to exist in the output folder."""
    images = result.outputs[save_node_id]["images"]
    paths = [server.output_dir / image["subfolder"] / image["filename"] for image in images]
    missing = [str(path) for path in paths if not path.is_file()]
    assert not missing, f"/history lists files that were not written: {missing}"
    return paths


def test_object_info_lists_every_wanmesh_node(comfyui_server: ComfyUIServer) -> None:
    info = comfyui_server.get_json("/object_info")
    missing = expected_node_ids() - info.keys()
    assert not missing, f"nodes missing from /object_info: {sorted(missing)}"
    wanmesh_nodes = {node_id: node for node_id, node in info.items() if node_id.startswith("WanMesh")}
    misnamed = [node_id for node_id, node in wanmesh_nodes.items() if not node["display_name"].startswith("WanMesh")]
    assert not misnamed, f"display names must start with 'WanMesh': {misnamed}"


def test_pack_imports_without_failures(comfyui_server: ComfyUIServer) -> None:
    startup_log = comfyui_server.log().split("Starting server")[0]
    pack_lines = [line for line in startup_log.splitlines() if PACK_FOLDER_NAME in line]
    assert pack_lines, f"the server log never mentions the pack folder {PACK_FOLDER_NAME}:\n{startup_log}"
    # A failed import is logged as "Cannot import <path>" and "(IMPORT FAILED): <path>"; a traceback
    # through the pack's files during start-up means something in it failed even if the import survived.
    failures = [line for line in pack_lines if re.search(r"IMPORT FAILED|Cannot import|File \"", line)]
    assert not failures, "\n".join(failures) + "\n--- server log ---\n" + startup_log


@pytest.mark.parametrize("name", API_WORKFLOWS)
def test_api_workflow_matches_node_definitions(comfyui_server: ComfyUIServer, name: str) -> None:
    """Widget inputs appear in the order the nodes declare them (the order UI-format widgets_values use)."""
    info = comfyui_server.get_json("/object_info")
    for node_id, node in load_workflow(f"api/{name}").items():
        node_info = info[node["class_type"]]
        assert api_widget_names(node) == widget_names_from_object_info(node_info), f"node {node_id}"
        declared = {**node_info["input"]["required"], **node_info["input"].get("optional", {})}
        unknown = [input_name for input_name in node["inputs"] if input_name not in declared]
        assert not unknown, f"node {node_id} ({node['class_type']}) has undeclared inputs {unknown}"


def test_t2v_workflow_writes_one_png_per_frame(comfyui_server: ComfyUIServer, t2v_prompt: dict[str, Any]) -> None:
    latent = node_of_type(t2v_prompt, "WanMeshEmptyLatent")["inputs"]
    save_node_id = next(node_id for node_id, node in t2v_prompt.items() if node["class_type"] == "SaveImage")
    prefix = t2v_prompt[save_node_id]["inputs"]["filename_prefix"]

    result = run_successfully(comfyui_server, t2v_prompt)

    paths = saved_images(comfyui_server, result, save_node_id)
    assert len(paths) == latent["length"] * latent["batch_size"]
    assert all(path.name.startswith(prefix) and path.suffix == ".png" for path in paths), paths
    for path in paths:
        with Image.open(path) as image:
            assert image.size == (latent["width"], latent["height"]), path
            pixels = np.asarray(image.convert("RGB"))
        assert pixels.reshape(-1, 3).std(axis=0).max() > 0, f"{path.name} is a single colour"


def test_bad_width_fails_clearly_and_server_keeps_serving(comfyui_server: ComfyUIServer,
                                                           t2v_prompt: dict[str, Any]) -> None:
    bad_prompt = with_fresh_seed(t2v_prompt)
    node_of_type(bad_prompt, "WanMeshEmptyLatent")["inputs"]["width"] = 100

    outcome = comfyui_server.run(bad_prompt, PROMPT_TIMEOUT_S)

    if isinstance(outcome, PromptResult):
        assert outcome.status == "error", "a width of 100 (not a multiple of 16) was accepted"
    message = outcome.error_text()
    assert "width" in message and "96" in message and "112" in message, (
        f"the error should name the input and the valid neighbours 96 and 112:\n{message}")
    run_successfully(comfyui_server, t2v_prompt)

