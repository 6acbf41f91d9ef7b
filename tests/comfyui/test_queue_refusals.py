"""Bad widget values are refused when the prompt is queued: ``POST /prompt`` answers 400 naming the field in one
line, as ComfyUI's own nodes do for their ranges, on the 2024 copy and on 0.33 (the nodes' ``VALIDATE_INPUTS``),
and nothing runs. A good prompt still passes the same check (ComfyUI's own range checks of the other inputs too).
A model, VAE and text encoder that do not fit together are refused when the prompt runs, by its first WanMesh
loader, in one line naming both files, before any worker starts."""

from __future__ import annotations

import copy
import math

import pytest

from comfyui_server import RejectedPrompt
from test_free_memory import workers, workers_exit

MAX_MESSAGE = 300

# (case id, node class, input, value, what the one line says)
BAD_VALUES = [
    ("length-10", "WanMeshEmptyLatent", "length", 10, "length 10 is not of the form 4k+1 (nearest valid: 9 or 13)"),
    ("width-100", "WanMeshEmptyLatent", "width", 100, "width 100 is not a positive multiple of 8 (nearest valid: 96 or 104)"),
    ("cfg-nan", "WanMeshSampler", "cfg", math.nan, "cfg nan is not a finite number; valid: 0 to 100"),
    ("shift-inf", "WanMeshSampler", "shift", math.inf, "shift inf is not a finite number"),
    ("denoise-above-max", "WanMeshSampler", "denoise", 2.0, "denoise 2 is out of range; valid: 0.01 to 1"),
    ("fps-nan", "WanMeshSaveVideo", "fps", math.nan, "fps nan is not a finite number"),
    ("overlap-too-big", "WanMeshVAEDecode", "overlap_px", 512, "overlap_px must be a multiple of"),
]


def _with(prompt: dict, node_class: str, name: str, value) -> dict:
    prompt = copy.deepcopy(prompt)
    node = next(node for node in prompt.values() if node["class_type"] == node_class)
    node["inputs"][name] = value
    if name == "overlap_px":
        node["inputs"]["tile_px"] = 256
    if node_class == "WanMeshSaveVideo":  # ComfyUI queues a prompt with another valid output node, without this one
        prompt = {key: node for key, node in prompt.items() if node["class_type"] != "SaveImage"}
    return prompt


@pytest.fixture(params=["2024", "recent"], scope="module")
def server(request):
    return request.getfixturevalue("comfyui_server" if request.param == "2024" else "recent_comfyui_server")


@pytest.mark.parametrize("case, node_class, name, value, message", BAD_VALUES, ids=[case[0] for case in BAD_VALUES])
def test_a_bad_widget_value_is_a_400_naming_the_field(server, t2v_prompt, case, node_class, name, value, message):
    rejected = server.submit(_with(t2v_prompt, node_class, name, value))
    assert isinstance(rejected, RejectedPrompt), f"{case}: queued as {rejected}"
    node_id = next(key for key, node in t2v_prompt.items() if node["class_type"] == node_class)
    errors = rejected.body["node_errors"][node_id]["errors"]
    details = [error["details"] for error in errors if error["type"] == "custom_validation_failed"]
    assert details, rejected.error_text()
    for detail in details:  # "<input> - <one line>", once per input the node checks
        line = detail.split(" - ", 1)[1]
        assert message in line and "\n" not in line and len(line) <= MAX_MESSAGE, detail
    print(f"\n{case}: {details[0]}")


def test_good_values_pass_the_queue_checks_and_run(server, t2v_prompt):
    result = server.run(_with(t2v_prompt, "WanMeshEmptyLatent", "length", 9), timeout_s=600)
    assert not isinstance(result, RejectedPrompt), result.error_text()
    assert result.status == "success", result.error_text()


# Files that do not fit together: refused by the first WanMesh loader that runs, from the headers, before the pool
# starts (nodes/bridge/prompt_checks.py). (case id, loader, its file input, the file swapped in, what the one line says)
MISMATCHED_FILES = [
    ("wan22-vae-with-wan21-model", "WanMeshVAELoader", "vae_name", "wan22_tiny_vae.safetensors",
     "vae_name wan22_tiny_vae.safetensors is the Wan 2.2 VAE (wan2.2_vae.safetensors), but model_name "
     "wan_tiny_t2v.safetensors works on 16-channel latents"),
    ("wide-text-encoder", "WanMeshTextEncoderLoader", "text_encoder_name", "umt5_native.safetensors",
     "text_encoder_name umt5_native.safetensors gives 4096-wide text embeddings, but model_name "
     "wan_tiny_t2v.safetensors reads 64-wide ones"),
]


@pytest.mark.parametrize("case, loader, name, value, message", MISMATCHED_FILES, ids=[c[0] for c in MISMATCHED_FILES])
def test_files_that_do_not_fit_are_refused_before_the_pool_starts(server, t2v_prompt, case, loader, name, value,
                                                                  message):
    workers_exit(server, free_memory=True)  # no pool: a load would start one
    result = server.run(_with(t2v_prompt, loader, name, value), timeout_s=120)
    assert not isinstance(result, RejectedPrompt) and result.status == "error", result.error_text()
    errors = [data for event, data in result.messages if event == "execution_error"]
    line = errors[0]["exception_message"].strip()
    assert errors[0]["node_type"] in ("WanMeshModelLoader", "WanMeshVAELoader", "WanMeshTextEncoderLoader"), errors
    assert message in line and "\n" not in line and len(line) <= MAX_MESSAGE, line
    assert not workers(server), "a worker pool started for a prompt whose files do not fit"
    print(f"\n{case}: {errors[0]['node_type']}: {line}")
