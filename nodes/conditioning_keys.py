"""The conditioning keys ComfyUI acts on for Wan models that WanMesh does not take yet: one table; runs in ComfyUI.

A CONDITIONING entry is a tensor and a dict of keys that ComfyUI's conditioning nodes set. ComfyUI's Wan model
turns some keys into model inputs (``audio_embed``, ``reference_motion``, ...) and its samplers act on others
(areas, masks, timestep ranges). The WanMesh Sampler reads the keys of ``convert.read_conditioning`` and refuses
every key of ``UNSUPPORTED_CONDITIONING`` in one line, naming it and the nodes that set it, before any worker
starts; the WanMesh MODEL refuses the model inputs of the table at its model call (``pool_model.py``), as ComfyUI's
own code handles the sampler keys there. A family that WanMesh learns to run takes its lines out of this table.
"""

from __future__ import annotations

# conditioning key: (the model input ComfyUI's Wan model gets from it, None for keys its samplers act on; what it
# is; the native nodes that set it)
UNSUPPORTED_CONDITIONING = {
    "audio_embed": ("audio_embed", "audio embeddings", "WanSoundImageToVideo or WanHuMoImageToVideo"),
    "control_video": ("control_video", "a sound-to-video control video", "WanSoundImageToVideo"),
    "reference_motion": ("reference_motion", "reference motion latents", "WanSoundImageToVideoExtend"),
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


def check_conditioning_keys(conditioning, name: str, model_inputs_only: bool = False) -> None:
    """Refuse, in one line naming the key and the nodes that set it, a CONDITIONING the WanMesh Sampler would
    otherwise sample without part of."""
    for entry in conditioning if isinstance(conditioning, (list, tuple)) else ():
        options = entry[1] if isinstance(entry, (list, tuple)) and len(entry) > 1 else None
        key = refused_key(options, model_inputs_only) if isinstance(options, dict) else None
        if key is not None:
            _, what, nodes = UNSUPPORTED_CONDITIONING[key]
            raise ValueError(f"{name} carries {key} ({what}, set by {nodes}), which WanMesh does not take yet; "
                             "sample without that node")


def model_input_refusal(model_input: str) -> str:
    """The one line the WanMesh MODEL raises for a model input of the table."""
    key, what, nodes = UNSUPPORTED_INPUTS[model_input]
    return (f"the WanMesh MODEL does not take {model_input} ({what}, from {key} set by {nodes}) yet; sample "
            "without that node")
