"""The conditioning keys ComfyUI acts on for Wan models, and which of them WanMesh takes: two tables; runs in ComfyUI.

A CONDITIONING entry is a tensor and a dict of keys that ComfyUI's conditioning nodes set. Each of ComfyUI's Wan
model classes turns some keys into model inputs (``NATIVE_WAN_CLASSES``: WAN21 reads the image-to-video keys,
WAN22_Animate the pose video, WAN_Animate2 its pose branch, ...) and drops every other key without a word; its
samplers act on others (areas, masks, timestep ranges). So a conditioning node of one family feeding a model of
another samples as if the node were not there (Animate-2's pose video on an image-to-video file samples plain
image-to-video). Both WanMesh entry points refuse that in one line naming the key, the node that set it and the
model it is for (``check_family_keys``): the WanMesh MODEL in its ``extra_conds``, where ComfyUI reads the keys,
and the WanMesh Sampler before any worker starts. ``UNSUPPORTED_CONDITIONING`` lists the keys a model WanMesh
runs reads but the pool does not take yet, and the sampler keys the workers' loop does not act on; the Sampler
refuses them all, the MODEL the model inputs among them (ComfyUI's own samplers act on the sampler keys there).
A family that WanMesh learns to run takes its lines out of these tables.
"""

from __future__ import annotations

# conditioning key: (the model input ComfyUI's Wan model gets from it, None for keys its samplers act on; what it
# is; the native nodes that set it)
UNSUPPORTED_CONDITIONING = {
    "context_latents": ("context_latents", "in-context video and reference latents", "BerniniConditioning"),
    "control": ("control", "a ControlNet", "ControlNetApply / ControlNetApplyAdvanced"),
    "area": (None, "an area", "ConditioningSetArea"),
    "mask": (None, "a mask", "ConditioningSetMask"),
    "strength": (None, "a strength", "ConditioningSetAreaStrength or ConditioningSetMask"),
    "start_percent": (None, "a timestep range", "ConditioningSetTimestepRange"),
    "end_percent": (None, "a timestep range", "ConditioningSetTimestepRange"),
    "hooks": (None, "hooks", "the hook nodes (SetClipHooks, ConditioningSetProperties)"),
}
# values of sampler keys that change nothing (a full timestep range, strength 1): not refused
NO_EFFECT = {"start_percent": 0.0, "end_percent": 1.0, "strength": 1.0}

# the model inputs of the table: model input name -> (conditioning key, what it is, the nodes that set it)
UNSUPPORTED_INPUTS = {model_input: (key, what, nodes) for key, (model_input, what, nodes)
                      in UNSUPPORTED_CONDITIONING.items() if model_input is not None}


def refused_key(options: dict, model_inputs_only: bool = False) -> str | None:
    """The first key of a conditioning entry's dict that the table refuses (with a value that changes something);
    ``model_inputs_only``: only keys that become model inputs (ComfyUI's samplers handle the others)."""
    for key, (model_input, _, _) in UNSUPPORTED_CONDITIONING.items():
        if model_inputs_only and model_input is None:
            continue
        value = options.get(key)
        if value is not None and not (key in NO_EFFECT and _equals(value, NO_EFFECT[key])):
            return key
    return None


def _equals(value, expected: float) -> bool:
    try:
        return float(value) == expected
    except (TypeError, ValueError):
        return False


def entry_options(conditioning):
    """The options dict of each ``[tensor, options]`` entry of a CONDITIONING (anything else yields nothing)."""
    for entry in conditioning if isinstance(conditioning, (list, tuple)) else ():
        if isinstance(entry, (list, tuple)) and len(entry) > 1 and isinstance(entry[1], dict):
            yield entry[1]


def check_conditioning_keys(conditioning, name: str, model_inputs_only: bool = False) -> None:
    """Refuse, in one line naming the key and the nodes that set it, a CONDITIONING the WanMesh Sampler would
    otherwise sample without part of."""
    for options in entry_options(conditioning):
        key = refused_key(options, model_inputs_only)
        if key is not None:
            _, what, nodes = UNSUPPORTED_CONDITIONING[key]
            raise ValueError(f"{name} carries {key} ({what}, set by {nodes}), which WanMesh does not take yet; "
                             "sample without that node")


def model_input_refusal(model_input: str) -> str:
    """The one line the WanMesh MODEL raises for a model input of the table."""
    key, what, nodes = UNSUPPORTED_INPUTS[model_input]
    return (f"the WanMesh MODEL does not take {model_input} ({what}, from {key} set by {nodes}) yet; sample "
            "without that node")


# ComfyUI's Wan model classes (comfy/model_base.py, 0.33): class -> (its base among them, the model it runs, the
# conditioning keys its own extra_conds read; a class also reads its base's). The unit tests read ComfyUI's
# source against it. Keys that no conditioning node sets (noise, denoise_mask, the text) are left out.
NATIVE_WAN_CLASSES = {
    "WAN21": (None, "Wan text- or image-to-video", frozenset({
        "clip_vision_output", "concat_latent_image", "concat_mask", "concat_mask_index", "context_latents",
        "reference_latents", "time_dim_concat"})),
    "WAN22": ("WAN21", "Wan 2.2 TI2V 5B", frozenset()),
    "WAN21_Vace": ("WAN21", "Wan VACE", frozenset({"vace_frames", "vace_mask", "vace_strength"})),
    "WAN21_Camera": ("WAN21", "Wan Fun Camera", frozenset({"camera_conditions"})),
    "WAN22_Animate": ("WAN21", "Wan 2.2 Animate", frozenset({"face_video_pixels", "pose_video_latent"})),
    "WAN_Animate2": ("WAN21", "Wan Animate-2", frozenset({
        "clip_vision_output_pose", "cross_attn_pose", "pose_strength", "pose_video_latent", "reference_strength"})),
    "WAN21_HuMo": ("WAN21", "Wan HuMo", frozenset({"audio_embed", "reference_latents"})),
    "WAN22_S2V": ("WAN21", "Wan 2.2 sound-to-video", frozenset({
        "audio_embed", "control_video", "reference_latents", "reference_motion"})),
    "WAN21_SCAIL": ("WAN21", "Wan SCAIL", frozenset({"pose_video_latent", "reference_latents"})),
    "WAN21_SCAIL2": ("WAN21_SCAIL", "Wan SCAIL 2", frozenset({
        "concat_mask", "driving_mask_28ch", "ref_mask_28ch", "ref_mask_flag"})),
    "WAN22_WanDancer": ("WAN21", "WanDancer", frozenset({
        "audio_embed", "audio_inject_scale", "clip_vision_output_ref", "fps"})),
}
# the native nodes that set each key read by only some of the classes, for the refusal line
FAMILY_KEY_NODES = {
    "pose_video_latent": "WanAnimateToVideo, WanAnimate2ToVideo or WanSCAILToVideo",
    "face_video_pixels": "WanAnimateToVideo",
    "clip_vision_output_pose": "WanAnimate2ToVideo", "cross_attn_pose": "WanAnimate2ToVideo",
    "pose_strength": "WanAnimate2ToVideo", "reference_strength": "WanAnimate2ToVideo",
    "vace_frames": "WanVaceToVideo", "vace_mask": "WanVaceToVideo", "vace_strength": "WanVaceToVideo",
    "camera_conditions": "WanCameraImageToVideo",
    "audio_embed": "WanSoundImageToVideo, WanHuMoImageToVideo or WanDancerVideo",
    "control_video": "WanSoundImageToVideo", "reference_motion": "WanSoundImageToVideoExtend",
    "driving_mask_28ch": "WanSCAILToVideo", "ref_mask_28ch": "WanSCAILToVideo", "ref_mask_flag": "WanSCAILToVideo",
    "audio_inject_scale": "WanDancerVideo", "clip_vision_output_ref": "WanDancerVideo", "fps": "WanDancerVideo",
}


def keys_read_by(class_name: str) -> frozenset:
    """The conditioning keys ComfyUI's Wan model class ``class_name`` reads, its bases' included."""
    base, _, keys = NATIVE_WAN_CLASSES[class_name]
    return keys | (keys_read_by(base) if base else frozenset())


def family_key_refusal(class_name: str, options: dict) -> str | None:
    """The one line refusing the first key of a conditioning entry's dict that another Wan model reads and
    ``class_name``'s model would drop; None when there is none."""
    taken = keys_read_by(class_name)
    for key, value in options.items():
        if value is None or key in taken or key not in FAMILY_KEY_NODES:
            continue
        for_models = " or ".join(model for _, model, keys in NATIVE_WAN_CLASSES.values() if key in keys)
        return (f"the conditioning carries {key} (set by {FAMILY_KEY_NODES[key]}) for a {for_models} model, but "
                f"this WanMesh model is a {NATIVE_WAN_CLASSES[class_name][1]} model, which would sample without it; "
                "load a file of the model that node is for (see the model families WanMesh runs), or remove the "
                "node")
    return None


def carries_family_keys(conditioning) -> bool:
    """Whether a CONDITIONING's entries hold a key only some Wan models read (so its model's class matters)."""
    return any(not FAMILY_KEY_NODES.keys().isdisjoint(options) for options in entry_options(conditioning))


def check_family_keys(conditioning, class_name: str) -> None:
    """Refuse a CONDITIONING (a list of entries, or one entry's dict) carrying a key that ``class_name``'s model
    would drop (``family_key_refusal``)."""
    entries = [[None, conditioning]] if isinstance(conditioning, dict) else conditioning
    for options in entry_options(entries):
        refusal = family_key_refusal(class_name, options)
        if refusal is not None:
            raise ValueError(refusal)
