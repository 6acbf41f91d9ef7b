"""The VACE example workflows (``workflows/api/vace_*.json``) run in a real 2024 ComfyUI server.

Runs in the test process; the server (``comfyui_server``) runs each workflow on a two-rank CPU pool with the
tiny models and the input media of ``workflows/inputs/`` (copied into its input folder by the fixture). Each
workflow exercises one VACE task (references, control video, moving-box inpainting, outpainting, extension)
and parallel modes of the pool; the checks are on the MP4 its WanMesh Save Video node writes.
"""

from __future__ import annotations

from typing import Any

import pytest
from comfyui_server import WORKFLOW_INPUTS_DIR, ComfyUIServer
from PIL import Image
from test_comfyui_server import assert_video, run_successfully, saved_video
from workflow_graph import WORKFLOWS_DIR, load_workflow, node_of_type, with_fresh_seed

VACE_WORKFLOWS = sorted(path.name for path in (WORKFLOWS_DIR / "api").glob("vace_*.json"))
POOL_MODES = ("tp", "ulysses", "ring", "cfg_parallel", "vae_patch")
COVERED_MODES = ("tp", "ulysses", "cfg_parallel", "vae_patch")
ENCODE_OUTPUT_TRIM_LATENT = 3  # WanMeshVaceEncode outputs: positive, negative, latent, trim_latent


def source_size(prompt: dict[str, Any], load_node_id: str) -> tuple[int, int]:
    """(width, height) of the input file a LoadImage node reads, read from the file itself."""
    with Image.open(WORKFLOW_INPUTS_DIR / prompt[load_node_id]["inputs"]["image"]) as image:
        return image.size


def expected_frame_size(prompt: dict[str, Any]) -> tuple[int, int]:
    """(width, height) the saved frames must have: the source video plus the paddings for outpainting, else the
    VACE encode's canvas."""
    masks = [node["inputs"] for node in prompt.values() if node["class_type"] == "WanMeshVaceMask"]
    if masks and masks[0]["mode"] == "outpaint":
        width, height = source_size(prompt, masks[0]["video"][0])
        return (width + masks[0]["pad_left"] + masks[0]["pad_right"],
                height + masks[0]["pad_top"] + masks[0]["pad_bottom"])
    encode = node_of_type(prompt, "WanMeshVaceEncode")["inputs"]
    return encode["width"], encode["height"]


def test_vace_workflows_cover_the_parallel_modes() -> None:
    """Every example runs on two CPU ranks; together they use tp, Ulysses, CFG parallel and VAE patch parallel.

    Examples next to each other in name order share a pool shape where they can (extend and inpaint use the
    t2v_tp2 shape, outpaint and r2v CFG parallel): the server then keeps its pool, and starting a pool is the
    slowest step of these runs.
    """
    assert len(VACE_WORKFLOWS) >= 5, VACE_WORKFLOWS
    used = set()
    for name in VACE_WORKFLOWS:
        pool = node_of_type(load_workflow(f"api/{name}"), "WanMeshPool")["inputs"]
        assert (pool["devices"], pool["world"]) == ("cpu:2", 2), f"{name}: {pool}"
        used |= {mode for mode in POOL_MODES if pool[mode] is True or (pool[mode] is not False and pool[mode] > 1)}
    assert set(COVERED_MODES) <= used, f"the examples use only {sorted(used)}"


def test_vace_workflows_trim_what_the_encode_says() -> None:
    """The trim node takes its amount from the encode's trim_latent output, not a hand-set number."""
    for name in VACE_WORKFLOWS:
        prompt = load_workflow(f"api/{name}")
        encode_id = next(node_id for node_id, node in prompt.items() if node["class_type"] == "WanMeshVaceEncode")
        trim = node_of_type(prompt, "WanMeshTrimLatent")["inputs"]
        assert trim["trim_amount"] == [encode_id, ENCODE_OUTPUT_TRIM_LATENT], f"{name}: {trim}"


@pytest.mark.parametrize("name", VACE_WORKFLOWS)
def test_vace_workflow_saves_an_mp4_of_the_generated_frames(comfyui_server: ComfyUIServer, name: str) -> None:
    """An MP4 of length frames of the expected size (reference frames trimmed, outpainting canvas grown), not flat."""
    prompt = with_fresh_seed(load_workflow(f"api/{name}"))
    encode = node_of_type(prompt, "WanMeshVaceEncode")["inputs"]
    width, height = expected_frame_size(prompt)
    assert (encode["width"], encode["height"]) == (width, height), f"the encode's canvas is not {width}x{height}"

    result = run_successfully(comfyui_server, prompt)

    # Without the trim, r2v's two reference latents would decode into 8 frames more than length.
    assert_video(saved_video(comfyui_server, result, prompt), encode["length"] * encode["batch_size"], width, height)


def test_example_inputs_are_in_the_server_input_folder(comfyui_server: ComfyUIServer) -> None:
    """Every file a VACE example loads is offered by LoadImage (the fixture copied workflows/inputs/)."""
    offered = set(comfyui_server.get_json("/object_info/LoadImage")["LoadImage"]["input"]["required"]["image"][0])
    needed = {node["inputs"]["image"] for name in VACE_WORKFLOWS for node in load_workflow(f"api/{name}").values()
              if node["class_type"] == "LoadImage"}
    assert needed and needed <= offered, f"LoadImage lacks {sorted(needed - offered)}; it offers {sorted(offered)}"
    assert all((comfyui_server.input_dir / file_name).is_file() for file_name in needed)
