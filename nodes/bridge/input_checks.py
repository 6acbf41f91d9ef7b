"""Queue-time checks of the nodes' widget values through ComfyUI's own input validation; runs in the ComfyUI process.

ComfyUI checks a widget's min and max when a prompt is queued (``POST /prompt``), but not a step (a width of 100,
a length of 10) and not NaN (``cfg: NaN`` is neither below a minimum nor above a maximum). ``install`` gives every
node with such inputs a ``VALIDATE_INPUTS`` classmethod (the classic node API, the same in the 2024 copies and in
0.33) listing exactly those inputs, so a bad value makes ``/prompt`` answer 400 with the field named, as
ComfyUI's own nodes do, and nothing runs. ComfyUI leaves the range check of a listed input to the node, so the
range is checked here too. The domain checks are ``config.py``'s (one place for each check); a linked input
(unknown until the graph runs) is checked when the node runs.
"""

from __future__ import annotations

import inspect
import math
import numbers

from ...parallel.config import check_frame_count, check_frame_size, check_tiles

VAE_MULTIPLE = 8  # what the WanMesh latents need (the VAE's spatial factor)
VACE_MULTIPLE = 16  # VACE canvases: whole patches


def _size(multiple: int, where: str = ""):
    """A width or height: a positive multiple of ``multiple`` (the other side is given a valid value)."""
    def width(value):
        check_frame_size(value, multiple, multiple, where)

    def height(value):
        check_frame_size(multiple, value, multiple, where)

    return {"width": width, "height": height}


def _length(where: str = ""):
    return {"length": lambda value: check_frame_count(value, f"{where}length")}


def _tiles(values: dict) -> None:
    if "tile_px" in values and "overlap_px" in values:
        tile = values["tile_px"]
        check_tiles(tile or None, values["overlap_px"] if tile else None)


# Per node: the inputs whose values ComfyUI's own range check does not fully check, with the domain check of
# each (None: the widget's range and, for numbers, finiteness only), and an optional check of several inputs.
NODE_CHECKS: dict[str, tuple[dict, object]] = {
    "WanMeshEmptyLatent": ({**_size(VAE_MULTIPLE), **_length()}, None),
    "WanMeshImageToVideo": ({**_size(VAE_MULTIPLE), **_length()}, None),
    "WanMeshWan22ImageToVideoLatent": ({**_size(VAE_MULTIPLE), **_length()}, None),
    "WanMeshVaceEncode": ({**_size(VACE_MULTIPLE, "VACE "), **_length("VACE "), "strength": None}, None),
    "WanMeshSampler": ({"cfg": None, "shift": None, "denoise": None, "boundary": None, "cfg_low_noise": None}, None),
    "WanMeshStreamSampler": ({"cfg": None, "shift": None, "fps": None}, None),
    "WanMeshVAEDecode": ({"tile_px": None, "overlap_px": None}, _tiles),
    "WanMeshVAEEncode": ({"tile_px": None, "overlap_px": None}, _tiles),
    "WanMeshLoraLoader": ({"strength": None}, None),
    "WanMeshSaveVideo": ({"fps": None}, None),
    "WanMeshPool": ({"worker_timeout": None, "memory_budget_gb": None}, None),
}


def _widget_specs(cls) -> dict[str, dict]:
    inputs = cls.INPUT_TYPES()
    return {name: spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            for group in ("required", "optional") for name, spec in inputs.get(group, {}).items()}


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else repr(value)


def check_range(name: str, value, spec: dict) -> None:
    """The widget's own range (ComfyUI's check, which it skips for the inputs a node validates) and, for a number,
    a finite value (NaN passes any min and max)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        low, high = spec.get("min"), spec.get("max")
        valid = f"valid: {_number(low)} to {_number(high)}" if low is not None and high is not None else "valid: a finite number"
        if not math.isfinite(value):
            raise ValueError(f"{name} {_number(value)} is not a finite number; {valid}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise ValueError(f"{name} {_number(value)} is out of range; {valid}")


def refusal(cls, node_id: str, values: dict) -> str | None:
    """The first problem of the given values as one line, or None; linked inputs (None here) are skipped."""
    checks, joint = NODE_CHECKS[node_id]
    given = {name: value for name, value in values.items() if value is not None}
    specs = _widget_specs(cls)
    try:
        for name, value in given.items():
            check_range(name, value, specs.get(name, {}))
            if checks.get(name) is not None:
                checks[name](value)
        if joint is not None:
            joint(given)
    except ValueError as error:
        return str(error).splitlines()[0][:300]
    return None


def _validator(node_id: str, names: tuple[str, ...]):
    def validate(cls, **values):
        return refusal(cls, node_id, values) or True

    # ComfyUI reads the inputs to pass from the signature (getfullargspec): exactly these, no **kwargs (a node
    # taking **kwargs would skip ComfyUI's checks of every other input too).
    parameters = [inspect.Parameter("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    parameters += [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None) for name in names]
    validate.__signature__ = inspect.Signature(parameters)
    validate.__name__ = validate.__qualname__ = "VALIDATE_INPUTS"
    validate.wanmesh_checks = True
    return classmethod(validate)


def install(node_classes: dict[str, type]) -> None:
    """Give every node of ``NODE_CHECKS`` its ``VALIDATE_INPUTS`` (once)."""
    for node_id, (checks, _) in NODE_CHECKS.items():
        cls = node_classes.get(node_id)
        if cls is not None and not getattr(getattr(cls, "VALIDATE_INPUTS", None), "wanmesh_checks", False):
            cls.VALIDATE_INPUTS = _validator(node_id, tuple(checks))
