"""The pack inside a real ComfyUI server: node registration, text-to-video through the worker pool, bad input.

Every prompt runs in a background pool of CPU ranks; the server fixture checks at teardown that no worker
process outlives the server.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from comfyui_server import ComfyUIServer, PromptResult, RejectedPrompt
from PIL import Image
from prepare_comfyui import PACK_FOLDER_NAME
from test_free_memory import workers
from workflow_graph import (WORKFLOWS_DIR, api_widget_names, is_link, load_workflow, node_of_type,
                            widget_names_from_object_info, with_fresh_seed, with_inputs)

from wanmesh.parallel import read_video

CORE_NODE_IDS = ("WanMeshPool", "WanMeshModelLoader", "WanMeshVAELoader", "WanMeshTextEncoderLoader",
                 "WanMeshTextEncode", "WanMeshEmptyLatent", "WanMeshSampler", "WanMeshVAEDecode", "WanMeshVAEEncode")
PROMPT_TIMEOUT_S = 420.0
# Latents of a parallel run agree with one rank's within 1e-4; after the VAE and 8-bit rounding that is a step or two.
PIXEL_TOLERANCE = 2
# Mean |MP4 - PNG| per frame, in 1/255. The tiny models make 64x64 colour noise, H.264's worst case (crf 19,
# 4:2:0 chroma): measured 12-17, while two different frames of the same video differ by 45-60.
VIDEO_MEAN_ERROR = 24.0
SINGLE_RANK_POOL = {"devices": "cpu", "world": 1, "tp": 1, "ulysses": 1, "ring": 1, "cfg_parallel": False,
                    "vae_patch": 1}
API_WORKFLOWS = sorted(path.name for path in (WORKFLOWS_DIR / "api").glob("*.json"))
VIDEO_NODE = "WanMeshSaveVideo"
ADDED_SAVE_IMAGE_ID = "901"  # a SaveImage a test adds next to a workflow's video output, for exact pixels


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


def save_node_id_of(prompt: dict[str, Any]) -> str:
    return next(node_id for node_id, node in prompt.items() if node["class_type"] == "SaveImage")


def video_node_id_of(prompt: dict[str, Any]) -> str:
    (node_id,) = [node_id for node_id, node in prompt.items() if node["class_type"] == VIDEO_NODE]
    return node_id


def with_png_frames(prompt: dict[str, Any], filename_prefix: str) -> dict[str, Any]:
    """The prompt with a SaveImage (prefix ``filename_prefix``) on the frames its video output saves: its own
    SaveImage when it has one, else one added as node ``ADDED_SAVE_IMAGE_ID``. PNG frames are exact; the MP4 is
    lossy, so pixel comparisons read the PNG frames."""
    if any(node["class_type"] == "SaveImage" for node in prompt.values()):
        return with_inputs(prompt, "SaveImage", filename_prefix=filename_prefix)
    frames = prompt[video_node_id_of(prompt)]["inputs"]["images"]
    return {**prompt, ADDED_SAVE_IMAGE_ID: {"class_type": "SaveImage",
                                            "inputs": {"images": frames, "filename_prefix": filename_prefix}}}


def read_png_frames(paths: list[Path]) -> np.ndarray:
    """PNG files as one ``[frames, H, W, 3]`` uint8 stack."""
    frames = []
    for path in paths:
        with Image.open(path) as image:
            frames.append(np.asarray(image.convert("RGB")))
    return np.stack(frames)


def run_to_frames(server: ComfyUIServer, prompt: dict[str, Any], filename_prefix: str) -> np.ndarray:
    """Run a prompt and read back its frames as PNG images (``with_png_frames``), ``[frames, H, W, 3]`` uint8."""
    prompt = with_png_frames(prompt, filename_prefix)
    result = run_successfully(server, prompt)
    return read_png_frames(saved_images(server, result, save_node_id_of(prompt)))


def saved_video(server: ComfyUIServer, result: PromptResult, prompt: dict[str, Any]) -> Path:
    """The one MP4 the prompt's WanMesh Save Video node reported in ``/history``, checked to exist."""
    node_id = video_node_id_of(prompt)
    (video,) = result.outputs[node_id]["images"]
    prefix = prompt[node_id]["inputs"]["filename_prefix"]
    path = server.output_dir / video["subfolder"] / video["filename"]
    assert path.is_file(), f"/history lists a video that was not written: {path}"
    assert path.name.startswith(prefix) and path.suffix == ".mp4", path.name
    return path


def assert_video(path: Path, frames: int, width: int, height: int) -> np.ndarray:
    """Reopen an MP4 with PyAV: ``frames`` frames of ``width`` x ``height``, not one flat colour; its pixels as
    ``[frames, H, W, 3]`` uint8."""
    pixels = (read_video(path) * 255).round().to(torch.uint8).numpy()
    assert pixels.shape == (frames, height, width, 3), (
        f"{path.name}: {pixels.shape}, expected {frames} frames of {width}x{height}")
    assert pixels.reshape(-1, 3).std(axis=0).max() > 0, f"{path.name} is a single colour"
    return pixels


def largest_pixel_difference(first: np.ndarray, second: np.ndarray) -> int:
    assert first.shape == second.shape, f"frame stacks differ in shape: {first.shape} vs {second.shape}"
    return int(np.abs(first.astype(np.int16) - second.astype(np.int16)).max())


def test_object_info_lists_every_wanmesh_node(comfyui_server: ComfyUIServer) -> None:
    info = comfyui_server.get_json("/object_info")
    missing = expected_node_ids() - info.keys()
    assert not missing, f"nodes missing from /object_info: {sorted(missing)}"
    wanmesh_nodes = {node_id: node for node_id, node in info.items() if node_id.startswith("WanMesh")}
    misnamed = [node_id for node_id, node in wanmesh_nodes.items() if not node["display_name"].startswith("WanMesh")]
    assert not misnamed, f"display names must start with 'WanMesh': {misnamed}"


def assert_pack_imported_cleanly(server: ComfyUIServer) -> None:
    """The start-up log names the pack and shows no failed import or traceback through its files."""
    startup_log = server.log().split("Starting server")[0]
    pack_lines = [line for line in startup_log.splitlines() if PACK_FOLDER_NAME in line]
    assert pack_lines, f"the server log never mentions the pack folder {PACK_FOLDER_NAME}:\n{startup_log}"
    # A failed import is logged as "Cannot import <path>" and "(IMPORT FAILED): <path>"; a traceback
    # through the pack's files during start-up means something in it failed even if the import survived.
    failures = [line for line in pack_lines if re.search(r"IMPORT FAILED|Cannot import|File \"", line)]
    assert not failures, "\n".join(failures) + "\n--- server log ---\n" + startup_log


def test_pack_imports_without_failures(comfyui_server: ComfyUIServer) -> None:
    assert_pack_imported_cleanly(comfyui_server)


@pytest.mark.parametrize("name", API_WORKFLOWS)
def test_api_workflow_matches_node_definitions(comfyui_server: ComfyUIServer, name: str) -> None:
    """Widget inputs appear in the order the nodes declare them (the order UI-format widgets_values use)."""
    info = comfyui_server.get_json("/object_info")
    for node_id, node in load_workflow(f"api/{name}").items():
        node_info = info[node["class_type"]]
        # A widget fed by a link (converted to an input, e.g. a trim amount from the VACE encode) has no value.
        linked = {input_name for input_name, value in node["inputs"].items() if is_link(value)}
        widgets = [input_name for input_name in widget_names_from_object_info(node_info) if input_name not in linked]
        assert api_widget_names(node) == widgets, f"node {node_id}"
        declared = {**node_info["input"]["required"], **node_info["input"].get("optional", {})}
        unknown = [input_name for input_name in node["inputs"] if input_name not in {*declared, *widgets}]
        assert not unknown, f"node {node_id} ({node['class_type']}) has undeclared inputs {unknown}"


def test_t2v_workflow_writes_an_mp4_and_one_png_per_frame(comfyui_server: ComfyUIServer,
                                                          t2v_prompt: dict[str, Any]) -> None:
    """The one example that keeps PNG frames: the MP4 holds the same frames, up to H.264's loss."""
    latent = node_of_type(t2v_prompt, "WanMeshEmptyLatent")["inputs"]
    pool = node_of_type(t2v_prompt, "WanMeshPool")["inputs"]
    assert (pool["devices"], pool["world"]) == ("cpu:2", 2), f"the example should run on two CPU ranks: {pool}"
    save_node_id = save_node_id_of(t2v_prompt)
    prefix = t2v_prompt[save_node_id]["inputs"]["filename_prefix"]

    result = run_successfully(comfyui_server, t2v_prompt)

    # The pool stays resident between prompts, so its workers are among the server's processes now.
    processes = comfyui_server.descendants()
    assert len(processes) >= pool["world"], f"expected {pool['world']} worker processes, found {processes}"

    paths = saved_images(comfyui_server, result, save_node_id)
    assert len(paths) == latent["length"] * latent["batch_size"]
    assert all(path.name.startswith(prefix) and path.suffix == ".png" for path in paths), paths
    for path in paths:
        with Image.open(path) as image:
            assert image.size == (latent["width"], latent["height"]), path
            pixels = np.asarray(image.convert("RGB"))
        assert pixels.reshape(-1, 3).std(axis=0).max() > 0, f"{path.name} is a single colour"
    video = assert_video(saved_video(comfyui_server, result, t2v_prompt), len(paths), latent["width"],
                         latent["height"])
    assert_video_shows_frames(video, read_png_frames(paths))


def assert_video_shows_frames(video: np.ndarray, frames: np.ndarray) -> None:
    """The MP4's frames are the PNG frames in order, up to H.264's loss: each decoded frame is closer to its own
    PNG than half its distance to any other frame (so order and content are checked, not only size)."""
    error = np.abs(video[:, None].astype(np.int16) - frames[None].astype(np.int16)).mean(axis=(2, 3, 4))
    own = error.diagonal()
    others = np.where(np.eye(len(frames), dtype=bool), np.inf, error).min(axis=1)
    assert (own < others / 2).all(), f"MP4 frame (row) vs PNG frame (column) mean errors:\n{error}"
    assert own.max() < VIDEO_MEAN_ERROR, f"the MP4 strays from the frames by {own}/255"


def test_bad_width_fails_clearly_and_server_keeps_serving(comfyui_server: ComfyUIServer,
                                                           t2v_prompt: dict[str, Any]) -> None:
    bad_prompt = with_fresh_seed(t2v_prompt)
    node_of_type(bad_prompt, "WanMeshEmptyLatent")["inputs"]["width"] = 100

    outcome = comfyui_server.run(bad_prompt, PROMPT_TIMEOUT_S)

    if isinstance(outcome, PromptResult):
        assert outcome.status == "error", "a width of 100 (not a multiple of 8) was accepted"
    message = outcome.error_text()
    assert "width" in message and "96" in message and "104" in message, (
        f"the error should name the input and the valid neighbours 96 and 104:\n{message}")
    run_successfully(comfyui_server, t2v_prompt)


def test_tensor_parallel_workflow_matches_one_rank(comfyui_server: ComfyUIServer) -> None:
    """``t2v_tp2`` (tp 2, VAE tiles over 2 ranks) writes the frames one rank writes with the same seed and tiles."""
    # The workflow's own fixed seed keeps the comparison repeatable (its graph differs from t2v's: no cache hit).
    parallel_prompt = load_workflow("api/t2v_tp2.json")
    pool = node_of_type(parallel_prompt, "WanMeshPool")["inputs"]
    assert (pool["world"], pool["tp"], pool["vae_patch"]) == (2, 2, 2), pool
    decode = node_of_type(parallel_prompt, "WanMeshVAEDecode")["inputs"]
    assert (decode["tile_px"], decode["overlap_px"]) == (32, 8), decode
    single_rank_prompt = with_inputs(parallel_prompt, "WanMeshPool", **SINGLE_RANK_POOL)
    seed = node_of_type(parallel_prompt, "WanMeshSampler")["inputs"]["seed"]
    other_seed_prompt = with_inputs(single_rank_prompt, "WanMeshSampler", seed=(seed + 1) % 2**31)

    parallel = run_to_frames(comfyui_server, parallel_prompt, "wanmesh_tp2")
    single_rank = run_to_frames(comfyui_server, single_rank_prompt, "wanmesh_world1")
    other_seed = run_to_frames(comfyui_server, other_seed_prompt, "wanmesh_world1_other_seed")

    latent = node_of_type(parallel_prompt, "WanMeshEmptyLatent")["inputs"]
    assert parallel.shape == (latent["length"], latent["height"], latent["width"], 3)
    difference = largest_pixel_difference(parallel, single_rank)
    assert difference <= PIXEL_TOLERANCE, f"tp 2 frames differ from one rank's by up to {difference}/255"
    # The comparison means something only if another seed lands well outside the tolerance.
    seed_difference = largest_pixel_difference(single_rank, other_seed)
    assert seed_difference > 8 * PIXEL_TOLERANCE, f"a different seed changed the frames by only {seed_difference}/255"


def test_a_prompt_longer_than_wan_reads_is_run_with_a_warning_that_counts_the_dropped_tokens(
        comfyui_server: ComfyUIServer) -> None:
    prompt = with_fresh_seed(with_inputs(with_inputs(load_workflow("api/t2v.json"), "WanMeshSampler", steps=1),
                                         "WanMeshEmptyLatent", width=32, height=32, length=5))
    for node in prompt.values():
        if node["class_type"] == "WanMeshTextEncode":
            node["inputs"]["text"] = " ".join(["a red fox runs through deep snow"] * 120)  # 840 words
    warnings_before = comfyui_server.log().count("WanMesh Text Encode: the prompt is ")
    run_successfully(comfyui_server, prompt)
    found = re.findall(r"WanMesh Text Encode: the prompt is (\d+) tokens; Wan reads the first 512, so (\d+) tokens",
                       comfyui_server.log())
    assert len(found) > warnings_before, f"no prompt-length warning in the log:\n{comfyui_server.log()[-3000:]}"
    tokens, dropped = map(int, found[-1])
    assert tokens > 840 and dropped == tokens - 512, found[-1]


def test_pool_layout_auto_chooses_per_job_logs_it_and_matches_one_rank(comfyui_server: ComfyUIServer) -> None:
    """The Pool node on layout auto (degrees left at 1): the sampler logs the cost model's table and its timings,
    the frames are one rank's, and a second job of the same size keeps the arranged pool (same workers)."""
    auto_prompt = with_inputs(load_workflow("api/t2v.json"), "WanMeshPool", layout="auto")
    seed = node_of_type(auto_prompt, "WanMeshSampler")["inputs"]["seed"]

    auto = run_to_frames(comfyui_server, auto_prompt, "wanmesh_auto_layout")
    log = comfyui_server.log()
    assert "auto layout (64x64, 5 frames, 4 steps)" in log and "s/step on the slowest of 2 ranks" in log, log[-3000:]
    pids = sorted(process.pid for process in workers(comfyui_server))
    run_successfully(comfyui_server, with_inputs(auto_prompt, "WanMeshSampler", seed=(seed + 1) % 2**31))
    assert sorted(process.pid for process in workers(comfyui_server)) == pids, "the same choice restarted the pool"
    single_rank = run_to_frames(comfyui_server, with_inputs(auto_prompt, "WanMeshPool", **SINGLE_RANK_POOL,
                                                             layout="manual"), "wanmesh_auto_layout_world1")
    difference = largest_pixel_difference(auto, single_rank)
    assert difference <= PIXEL_TOLERANCE, f"the auto layout's frames differ from one rank's by up to {difference}/255"


def test_pool_layout_auto_with_a_degree_set_is_one_line_error(comfyui_server: ComfyUIServer) -> None:
    prompt = with_inputs(load_workflow("api/t2v.json"), "WanMeshPool", layout="auto", tp=2)
    outcome = comfyui_server.run(prompt, PROMPT_TIMEOUT_S)
    assert isinstance(outcome, RejectedPrompt) or outcome.status == "error"
    assert "layout auto chooses the degrees itself; set tp=2 back to 1" in outcome.error_text()
