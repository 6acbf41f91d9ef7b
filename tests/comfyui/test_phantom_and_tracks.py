"""Phantom (subject images concatenated in time) and ATI tracks in a real ComfyUI (recent), as API prompts.

One prompt per pool layout holds the families: native ``WanPhantomSubjectToVideo`` (two subject images, so two
latent frames follow the sampled ones; its ``negative_img_text`` output, whose concatenated frames are zeros, as
the negative: the two guidance passes carry different frames) on the T2V native twin; native ``WanTrackToVideo``
(a small tracks JSON, a start image and its CLIP vision tokens) on the I2V twin; and the passes with image channels
of their own, as ``WanMoveTrackToVideo`` gives them (positive from WanTrackToVideo, negative from
WanImageToVideo). Each is sampled by native KSampler on ``UNETLoader``'s model, by KSampler on the WanMesh MODEL
and by the WanMesh Sampler (the workers' loop). World 1 is within 1e-4 of native; Ulysses 2 (the sequence split
covers the added frames) and tp 2 x CFG parallel 2 equal world 1. Conditioning WanMesh does not take is refused in
one line naming the key and the node, after which the server goes on; the example workflows of both families run.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from comfyui_server import ComfyUIServer, PromptResult
from test_comfyui_server import assert_video, run_successfully, saved_video
from test_image_to_video import ksampler, wanmesh_sampler
from test_native_sampling import TOLERANCE, largest_difference, pool_and_prompts, save_latent, saved
from workflow_graph import load_workflow, node_of_type

WIDTH, HEIGHT, LENGTH = 48, 32, 9  # 3 latent frames; Phantom adds one per subject image
# two tracks across the 48 x 32 video, one point per frame (ATI's JSON: a list of tracks of {x, y} points)
TRACKS = json.dumps([[{"x": 8 + 4 * i, "y": 8 + i} for i in range(LENGTH)],
                     [{"x": 40 - 3 * i, "y": 24 - 2 * i} for i in range(LENGTH)]])
SIZE = {"width": WIDTH, "height": HEIGHT, "length": LENGTH, "batch_size": 1}
# family: (model file, native conditioning node and its inputs, its (positive, negative, latent) outputs)
FAMILIES = {
    "phantom": ("wan_native_t2v.safetensors", "WanPhantomSubjectToVideo", {"images": ["subjects", 0]}, (0, 2, 3)),
    "ati": ("wan_tiny_i2v.safetensors", "WanTrackToVideo",
            {"tracks": TRACKS, "temperature": 220.0, "topk": 2, "start_image": ["start", 0],
             "clip_vision_output": ["clip_start", 0]}, (0, 1, 2)),
    # the guidance passes with image channels of their own, as WanMoveTrackToVideo gives them (its track features
    # on the positive's only): positive and latent from WanTrackToVideo, negative from WanImageToVideo
    # (another start image for the negative, so that its channels differ far from the positive's)
    "tracks_vs_image": ("wan_tiny_i2v.safetensors", "WanImageToVideo",
                        {"start_image": ["other", 0], "clip_vision_output": ["clip_start", 0]}, (0, 1, 2)),
}
MIXED = {"tracks_vs_image": "ati"}  # family: the family whose conditioning gives its positive and latent
# Phantom's guidance between the subject frames and zeros makes large latents (float32 noise grows with them):
# a lower scale keeps them at the other families' size
FAMILY_CFG = {"phantom": 2.0, "ati": 5.0, "tracks_vs_image": 5.0}
LAYOUTS = {"world1": dict(devices="cpu:1", world=1), "ulysses2": dict(devices="cpu:2", world=2, ulysses=2),
           "tp2_cfg2": dict(devices="cpu:4", world=4, tp=2, cfg_parallel=True)}
# the families each layout samples: ATI's conditioning only changes the image channels, which Ulysses and tp 2 x
# CFG 2 run for the image-to-video kinds already (test_image_to_video.py); Phantom's added frames and the passes'
# own image channels (CFG parallel gives each pass to other ranks, here with ATI's positive) are new
LAYOUT_FAMILIES = {"world1": tuple(FAMILIES), "ulysses2": ("phantom",), "tp2_cfg2": ("phantom", "tracks_vs_image")}
SIDES = ("native", "model", "sampler")


def with_outputs(node: dict[str, Any], family: str) -> dict[str, Any]:
    """A sampler node of ``test_image_to_video`` fed from the family's conditioning outputs."""
    positive, negative, latent = FAMILIES[family][3]
    inputs = {**node["inputs"], "cfg": FAMILY_CFG[family]}
    conditioning = inputs["positive"][0]
    source = f"{MIXED[family]}_cond" if family in MIXED else conditioning
    inputs.update(positive=[source, positive], negative=[conditioning, negative], latent_image=[source, latent])
    return {**node, "inputs": inputs}


def family_prompt(layout: dict[str, Any], native: bool,
                  families: tuple[str, ...] = tuple(FAMILIES)) -> dict[str, Any]:
    """Both families' samplings on one pool; node ``{family}_{side}`` saves the latent of that side (the native
    side only when ``native``: the parallel layouts are compared with one rank)."""
    prompt: dict[str, Any] = {
        **pool_and_prompts(layout),
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_tiny_vae.safetensors"}},
        "start": {"class_type": "LoadImage", "inputs": {"image": "ref_circle.png"}},
        "other": {"class_type": "LoadImage", "inputs": {"image": "ref_texture.png"}},
        "subjects": {"class_type": "ImageBatch", "inputs": {"image1": ["start", 0], "image2": ["other", 0]}},
        "clip": {"class_type": "WanMeshCLIPVisionLoader", "inputs": {"clip_name": "clip_vision_tiny.safetensors"}},
        "clip_start": {"class_type": "WanMeshCLIPVisionEncode",
                       "inputs": {"clip_vision": ["clip", 0], "image": ["start", 0], "crop": "center"}},
    }
    for family in (*families, *(MIXED[family] for family in families if family in MIXED)):
        model_file, node, inputs, _ = FAMILIES[family]
        prompt[f"{family}_cond"] = {"class_type": node, "inputs": {
            "positive": ["pos", 0], "negative": ["neg", 0], "vae": ["vae", 0], **SIZE, **inputs}}
        if family not in families:
            continue  # the conditioning of a mixed family's positive only
        prompt[f"{family}_wm"] = {"class_type": "WanMeshModelLoader",
                                  "inputs": {"model_name": model_file, "dtype": "fp32", "pool": ["pool", 0]}}
        prompt[f"{family}_wmodel"] = {"class_type": "WanMeshNativeModel", "inputs": {"model": [f"{family}_wm", 0]}}
        samplers = {"model": ksampler(f"{family}_wmodel", f"{family}_cond"),
                    "sampler": wanmesh_sampler(f"{family}_wm", f"{family}_cond")}
        if native:
            prompt[f"{family}_unet"] = {"class_type": "UNETLoader",
                                        "inputs": {"unet_name": model_file, "weight_dtype": "default"}}
            samplers["native"] = ksampler(f"{family}_unet", f"{family}_cond")
        for side, sampler in samplers.items():
            prompt[f"{family}_{side}_k"] = with_outputs(sampler, family)
            prompt[f"{family}_{side}"] = save_latent(f"{family}_{side}_k", f"families_{family}_{side}")
    return prompt


def with_phantom_variants(prompt: dict[str, Any]) -> dict[str, Any]:
    """Adds a native Phantom sampling that must differ from ``phantom_native``: ``phantom_negative_text`` against
    the ``negative_text`` output (the subject frames in the negative pass too, instead of zeros)."""
    prompt = dict(prompt)
    negative_text = with_outputs(ksampler("phantom_unet", "phantom_cond"), "phantom")
    negative_text["inputs"]["negative"] = ["phantom_cond", 1]
    for name, node in (("phantom_negative_text", negative_text),):
        prompt[f"{name}_k"] = node
        prompt[name] = save_latent(f"{name}_k", f"families_{name}")
    return prompt


PHANTOM_VARIANTS = ("phantom_negative_text",)


@pytest.fixture(scope="module")
def layout_latents(recent_comfyui_server: ComfyUIServer) -> dict[str, dict[str, Any]]:
    latents = {}
    for name, layout in LAYOUTS.items():
        native = name == "world1"
        prompt = family_prompt(layout, native, LAYOUT_FAMILIES[name])
        result = run_successfully(recent_comfyui_server, with_phantom_variants(prompt) if native else prompt)
        nodes = [f"{family}_{side}" for family in LAYOUT_FAMILIES[name] for side in (SIDES if native else SIDES[1:])]
        latents[name] = {node: saved(recent_comfyui_server, result, node)
                         for node in nodes + (list(PHANTOM_VARIANTS) if native else [])}
    return latents


@pytest.mark.parametrize("family, side", [(family, side) for family in FAMILIES for side in SIDES[1:]])
def test_wanmesh_equals_native(layout_latents, family: str, side: str) -> None:
    native, wanmesh = layout_latents["world1"][f"{family}_native"], layout_latents["world1"][f"{family}_{side}"]
    assert native.shape == (1, 16, (LENGTH - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8), native.shape
    assert native.abs().max().item() > 0.1, "the native latent is flat: the comparison proves nothing"
    difference = largest_difference(native, wanmesh)
    assert difference <= TOLERANCE, f"{family} {side}: {difference:.3g} from native"


@pytest.mark.parametrize("layout, family", [(layout, family) for layout, families in LAYOUT_FAMILIES.items()
                                            if layout != "world1" for family in families])
def test_parallel_layout_equals_one_rank(layout_latents, layout: str, family: str) -> None:
    for side in SIDES[1:]:
        difference = largest_difference(layout_latents[layout][f"{family}_{side}"],
                                        layout_latents["world1"][f"{family}_{side}"])
        assert difference <= TOLERANCE, f"{layout} {family} {side}: {difference:.3g} from world 1"


def test_the_negative_pass_takes_its_own_image_channels(layout_latents) -> None:
    """The negative pass's image channels (WanImageToVideo's) differ from the positive's (WanTrackToVideo's) and
    change the result far beyond the tolerance, so the equalities above compare them."""
    world1 = layout_latents["world1"]
    assert largest_difference(world1["tracks_vs_image_native"], world1["ati_native"]) > 100 * TOLERANCE


@pytest.mark.parametrize("variant", PHANTOM_VARIANTS)
def test_the_subject_frames_of_each_pass_reach_the_model(layout_latents, variant: str) -> None:
    """The subject frames in the negative pass too (``negative_text``) change the native latent far beyond the
    tolerance, so the equalities above compare the added frames of each pass."""
    world1 = layout_latents["world1"]
    assert largest_difference(world1[variant], world1["phantom_native"]) > 100 * TOLERANCE


# (the node that sets the key on the positive prompt, its extra inputs, the key, the sampler: "sampler" the WanMesh
# Sampler's workers' loop; the WanMesh MODEL's refusal of model inputs is unit-tested: the keys left in the table
# reach ComfyUI's T2V / I2V model only through a ControlNet)
REFUSALS = {
    "timestep_range": ("ConditioningSetTimestepRange", {"start": 0.2, "end": 1.0}, "start_percent", "sampler"),
    "area": ("ConditioningSetArea", {"width": 64, "height": 64, "x": 0, "y": 0, "strength": 1.0}, "area", "sampler"),
}
LAST_LAYOUT = list(LAYOUTS)[-1]  # the refusals reuse its pool and loaded model (ComfyUI caches those nodes)


def refusal_prompt(case: str | None) -> dict[str, Any]:
    """Phantom's WanMesh Sampler or KSampler on the WanMesh MODEL, its positive through the node of ``case`` (none:
    Phantom's own positive, with another seed)."""
    node, inputs, _, side = REFUSALS[case or list(REFUSALS)[0]]
    prompt = family_prompt(LAYOUTS[LAST_LAYOUT], native=False, families=("phantom",))
    keep = {"pool", "te", "pos", "neg", "vae", "start", "other", "subjects", "phantom_cond", "phantom_wm",
            "phantom_wmodel", f"phantom_{side}_k", f"phantom_{side}"}
    prompt = {key: value for key, value in prompt.items() if key in keep}
    if case is None:
        prompt[f"phantom_{side}_k"]["inputs"]["seed"] += 1
        return prompt
    prompt["keyed"] = {"class_type": node, "inputs": {"conditioning": ["pos", 0], **inputs}}
    prompt[f"phantom_{side}_k"]["inputs"]["positive"] = ["keyed", 0]
    return prompt


@pytest.mark.parametrize("case", REFUSALS)
def test_conditioning_wanmesh_does_not_take_is_one_line(recent_comfyui_server: ComfyUIServer, layout_latents,
                                                        case: str) -> None:
    node, _, key, _ = REFUSALS[case]
    result = recent_comfyui_server.run(refusal_prompt(case), 300)
    assert isinstance(result, PromptResult) and result.status == "error", f"{case} was sampled"
    (error,) = [data for event, data in result.messages if event == "execution_error"]
    message = error["exception_message"].strip()
    assert key in message and node in message, message
    assert "\n" not in message and len(message) <= 300, message


def test_after_the_refusals_the_server_goes_on(recent_comfyui_server: ComfyUIServer, layout_latents) -> None:
    run_successfully(recent_comfyui_server, refusal_prompt(None))


FAMILY_WORKFLOWS = {"phantom_native": "WanPhantomSubjectToVideo", "ati_native": "WanTrackToVideo"}


@pytest.mark.parametrize("name", FAMILY_WORKFLOWS)
def test_family_workflow_runs_as_an_api_prompt(recent_comfyui_server: ComfyUIServer, name: str) -> None:
    prompt = load_workflow(f"native/api/{name}.json")
    size = node_of_type(prompt, FAMILY_WORKFLOWS[name])["inputs"]
    result = run_successfully(recent_comfyui_server, prompt)
    assert_video(saved_video(recent_comfyui_server, result, prompt), size["length"], size["width"], size["height"])
