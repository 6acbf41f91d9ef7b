"""The table of conditioning keys WanMesh refuses, against ComfyUI's Wan model code, and each guidance pass's frames
concatenated in time (Phantom) as the workers' loop gives them to the model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from wanmesh.nodes.bridge.convert import ANIMATE_KEYS
from wanmesh.nodes.bridge.conditioning_keys import (FAMILY_KEY_NODES, NATIVE_WAN_CLASSES, NO_EFFECT,
                                             UNSUPPORTED_CONDITIONING, UNSUPPORTED_INPUTS, check_conditioning_keys,
                                             check_family_keys, keys_read_by, model_input_refusal)
from wanmesh.parallel.sampling.guidance import PASS_INPUTS, TIME_CONCAT, guided_prediction

MODEL_BASE = Path(__file__).resolve().parents[2] / "build" / "comfyui-recent" / "comfy" / "model_base.py"
# the keys WanMesh reads (convert.read_conditioning), and those ComfyUI's Wan code reads from elsewhere than a
# conditioning node's dict (the LATENT's noise and masks, the text itself)
READ_BY_WANMESH = {"concat_latent_image", "concat_mask", "clip_vision_output", "time_dim_concat", "vace_frames",
                   "vace_mask", "vace_strength", "concat_mask_index", "reference_latents", "camera_conditions",
                   *ANIMATE_KEYS}  # Animate's: the MODEL and the Sampler take them (convert.py)
NOT_FROM_CONDITIONING_NODES = {"noise", "denoise_mask", "latent_image", "cross_attn", "cross_attn_controlnet",
                               "noise_concat"}


def wan_class_keys() -> dict[str, tuple[str, set[str]]]:
    """Each Wan model class of ComfyUI's source (and BaseModel): (its first base, the keys its extra_conds read)."""
    source = MODEL_BASE.read_text(encoding="utf-8")
    classes = {}
    for match in re.finditer(r"^class (\w+)\((\w+)", source, re.M):
        if "WAN" in match.group(1).upper() or match.group(1) == "BaseModel":
            body = source[match.end():].split("\nclass ", 1)[0]
            classes[match.group(1)] = (match.group(2), set(re.findall(r'kwargs\.get\("(\w+)"', body)))
    return classes


needs_recent = pytest.mark.skipif(not MODEL_BASE.is_file(), reason="no prepared recent ComfyUI copy")


@needs_recent
def test_every_key_comfyui_wan_reads_is_taken_or_refused() -> None:
    keys = set().union(*(read for _, read in wan_class_keys().values()))
    assert "time_dim_concat" in keys and "camera_conditions" in keys, "the reading of ComfyUI's code broke"
    family_keys = set().union(*(read for _, _, read in NATIVE_WAN_CLASSES.values()))
    unknown = keys - READ_BY_WANMESH - NOT_FROM_CONDITIONING_NODES - set(UNSUPPORTED_CONDITIONING) - family_keys
    assert not unknown, f"ComfyUI's Wan model acts on {sorted(unknown)}: take them or add them to the tables"


@needs_recent
def test_the_table_of_wan_model_classes_is_comfyuis() -> None:
    """Every Wan model class of ComfyUI (bar the causal and FlowRVS ones, which read nothing of their own) is in
    the table with its base and exactly the conditioning keys it reads; each key only some classes read names the
    nodes that set it."""
    source = {name: (base, read - NOT_FROM_CONDITIONING_NODES) for name, (base, read) in wan_class_keys().items()
              if name not in ("BaseModel", "WAN21_CausalAR", "WAN21_FlowRVS")}
    table = {name: (base or "BaseModel", set(read)) for name, (base, _, read) in NATIVE_WAN_CLASSES.items()}
    assert table == source
    partial = {key for name in NATIVE_WAN_CLASSES for key in keys_read_by(name)} - keys_read_by("WAN21")
    assert partial == set(FAMILY_KEY_NODES)


@pytest.mark.parametrize("key", sorted(FAMILY_KEY_NODES))
def test_a_key_of_another_wan_model_is_refused_naming_it_its_node_and_both_models(key: str) -> None:
    readers = [name for name, (_, _, read) in NATIVE_WAN_CLASSES.items() if key in read]
    others = [name for name in NATIVE_WAN_CLASSES if key not in keys_read_by(name)]
    for name in others:
        with pytest.raises(ValueError) as refused:
            check_family_keys([[torch.zeros(1, 4, 8), {key: torch.zeros(1)}]], name)
        message = str(refused.value)
        assert key in message and FAMILY_KEY_NODES[key] in message and NATIVE_WAN_CLASSES[name][1] in message
        assert all(NATIVE_WAN_CLASSES[reader][1] in message for reader in readers) and "\n" not in message
    for name in set(NATIVE_WAN_CLASSES) - set(others):
        check_family_keys({key: torch.zeros(1), "noise": torch.zeros(1)}, name)  # extra_conds' keyword form


@pytest.mark.parametrize("key", UNSUPPORTED_CONDITIONING)
def test_each_refused_key_is_one_line_naming_it_and_its_node(key: str) -> None:
    value = 0.5 if key in NO_EFFECT else torch.zeros(1)
    conditioning = [[torch.zeros(1, 4, 8), {key: value}]]
    with pytest.raises(ValueError) as refused:
        check_conditioning_keys(conditioning, "positive")
    message = str(refused.value)
    _, _, nodes = UNSUPPORTED_CONDITIONING[key]
    assert key in message and nodes in message and "\n" not in message and len(message) <= 300, message


def test_sampler_keys_pass_on_the_comfyui_path_and_no_effect_values_pass() -> None:
    check_conditioning_keys([[torch.zeros(1, 4, 8), {"start_percent": 0.3}]], "positive", model_inputs_only=True)
    check_conditioning_keys([[torch.zeros(1, 4, 8), {"start_percent": 0.0, "end_percent": 1.0, "strength": 1.0}]],
                            "positive")
    with pytest.raises(ValueError, match="context_latents"):
        check_conditioning_keys([[torch.zeros(1, 4, 8), {"context_latents": [torch.zeros(1)]}]], "negative",
                                model_inputs_only=True)


def test_model_input_refusals_name_the_conditioning_key() -> None:
    for model_input, (key, _, nodes) in UNSUPPORTED_INPUTS.items():
        message = model_input_refusal(model_input)
        assert model_input in message and key in message and nodes in message and len(message) <= 300, message


class RecordingModel:
    """Stands in for the transformer: records each call's input and returns it (as a 'prediction')."""

    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []

    def __call__(self, hidden_states, timestep, encoder_hidden_states, return_dict, **kwargs):
        self.inputs.append(hidden_states.clone())
        return (hidden_states * 2.0,)


def test_each_guidance_pass_gets_its_own_frames_after_the_latent() -> None:
    latents = torch.randn(1, 16, 3, 2, 2)
    subjects, zeros = torch.randn(1, 16, 2, 2, 2), torch.zeros(1, 16, 2, 2, 2)
    model = RecordingModel()
    extra = {PASS_INPUTS: ({TIME_CONCAT: subjects}, {TIME_CONCAT: zeros})}
    prediction = guided_prediction(model, latents, torch.tensor(500.0), torch.zeros(1, 4, 8), torch.ones(1, 4, 8),
                                   3.0, extra)
    conditional, unconditional = model.inputs
    assert torch.equal(conditional, torch.cat([latents, subjects], dim=2))
    assert torch.equal(unconditional, torch.cat([latents, zeros], dim=2))
    assert prediction.shape == latents.shape and torch.allclose(prediction, latents * 2.0)


def test_time_concat_of_another_size_is_one_line_before_sending() -> None:
    from wanmesh.parallel.protocol import SampleRequest

    latent = torch.zeros(1, 16, 3, 4, 6)
    request = SampleRequest(handle="m", latent=latent, positive=[torch.zeros(4, 8)], negative=[torch.zeros(4, 8)],
                            seed=1, steps=2, guidance_scale=5.0, shift=8.0, sampler="euler", scheduler="simple",
                            time_latents_negative=torch.zeros(1, 16, 2, 4, 4))
    with pytest.raises(ValueError) as refused:
        request.validate()
    message = str(refused.value)
    assert "negative" in message and "time_dim_concat" in message and "[1, 16, 2, 4, 4]" in message, message
    assert "\n" not in message and len(message) <= 300, message


def test_the_wanmesh_model_refuses_time_concat_that_cannot_follow_its_input() -> None:
    from wanmesh.nodes.bridge.pool_model import with_time_concat

    x = torch.zeros(2, 36, 3, 4, 6)  # an image-to-video input: its image channels are already concatenated
    assert with_time_concat(x, None, torch.zeros(2)) is x
    with pytest.raises(ValueError, match=r"time_dim_concat \[2, 16, 2, 4, 6\] cannot follow the model input"):
        with_time_concat(x, torch.zeros(2, 16, 2, 4, 6), torch.zeros(2))
    joined = with_time_concat(torch.zeros(2, 16, 3, 4, 6), torch.ones(2, 16, 2, 4, 6), torch.zeros(2))
    assert joined.shape == (2, 16, 5, 4, 6) and joined[:, :, 3:].eq(1).all() and joined[:, :, :3].eq(0).all()


def test_the_wanmesh_model_refuses_a_controlnet_in_one_line() -> None:
    from wanmesh.nodes.bridge.pool_model import check_supported_inputs

    check_supported_inputs(None, {"reference_latent": torch.zeros(1), "vace_context": None})
    with pytest.raises(ValueError) as refused:
        check_supported_inputs(object(), {})
    message = str(refused.value)
    assert "control" in message and "ControlNetApply" in message and len(message) <= 300, message


def test_the_wanmesh_model_refuses_a_model_input_it_does_not_know() -> None:
    """A model input no table knows (a newer ComfyUI's, another pack's) stops the call instead of being dropped."""
    from wanmesh.nodes.bridge.pool_model import check_supported_inputs

    with pytest.raises(ValueError, match="model input pose_branch_tokens .*sample without that node"):
        check_supported_inputs(None, {"pose_branch_tokens": torch.zeros(1), "denoise_mask": torch.zeros(1)})
