"""Read ComfyUI workflows in both formats as one comparable graph description.

UI format (what the browser saves and loads by drag and drop) keeps widget
values as a positional list and connections in a separate ``links`` table; API
format (what ``POST /prompt`` takes) keeps named inputs where a connection is
``[source_node_id, output_slot]``. ``describe_api`` and ``describe_ui`` turn
both into ``{node_id: NodeDescription}`` so the two can be compared.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKFLOWS_DIR = Path(__file__).resolve().parents[2] / "workflows"
MAX_SEED = 2**31 - 1

# The browser adds a "control after generate" widget after seed widgets; API format has no such input.
SEED_INPUT_NAMES = ("seed", "noise_seed")
CONTROL_AFTER_GENERATE_VALUES = ("fixed", "increment", "decrement", "randomize")
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")  # COMBO: a choice in the newer node schema
UPLOAD_WIDGET_NAME = "upload"  # the 2024 frontend's image upload button (see widget_names_from_object_info)


@dataclass(frozen=True)
class NodeDescription:
    class_type: str
    links: dict[str, tuple[str, int]]  # input name -> (source node id, output slot)
    widget_values: tuple[Any, ...]  # in widget order, without control-after-generate values


def load_workflow(relative_path: str) -> dict[str, Any]:
    """A workflow from ``workflows/``, e.g. ``"api/t2v.json"``."""
    return json.loads((WORKFLOWS_DIR / relative_path).read_text(encoding="utf-8"))


def node_of_type(prompt: dict[str, Any], class_type: str) -> dict[str, Any]:
    """The one node of ``class_type`` in an API-format prompt."""
    matches = [node for node in prompt.values() if node["class_type"] == class_type]
    if len(matches) != 1:
        raise ValueError(f"expected one {class_type} node, found {len(matches)}")
    return matches[0]


def with_inputs(prompt: dict[str, Any], class_type: str, **inputs: Any) -> dict[str, Any]:
    """A copy of an API-format prompt with some inputs of its one ``class_type`` node replaced."""
    changed = copy.deepcopy(prompt)
    node_inputs = node_of_type(changed, class_type)["inputs"]
    unknown = sorted(set(inputs) - node_inputs.keys())
    if unknown:
        raise ValueError(f"{class_type} has no inputs {unknown}; it has {sorted(node_inputs)}")
    node_inputs.update(inputs)
    return changed


def with_fresh_seed(prompt: dict[str, Any]) -> dict[str, Any]:
    """A copy of an API-format prompt with a new sampler seed, so ComfyUI's cache cannot answer it."""
    return with_inputs(prompt, "WanMeshSampler", seed=random.randint(0, MAX_SEED))


def is_link(value: Any) -> bool:
    return (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
            and isinstance(value[1], int))


def describe_api(prompt: dict[str, Any]) -> dict[str, NodeDescription]:
    graph = {}
    for node_id, node in prompt.items():
        inputs = node["inputs"]
        links = {name: (value[0], value[1]) for name, value in inputs.items() if is_link(value)}
        widgets = tuple(value for value in inputs.values() if not is_link(value))
        graph[node_id] = NodeDescription(node["class_type"], links, widgets)
    return graph


def api_widget_names(node: dict[str, Any]) -> list[str]:
    return [name for name, value in node["inputs"].items() if not is_link(value)]


def describe_ui(workflow: dict[str, Any], widget_names: dict[str, list[str]]) -> dict[str, NodeDescription]:
    """Describe a UI-format workflow; ``widget_names[class_type]`` lists the node's widgets in order."""
    link_sources = {link[0]: (str(link[1]), link[2]) for link in workflow["links"]}
    graph = {}
    for node in workflow["nodes"]:
        links = {slot["name"]: link_sources[slot["link"]] for slot in node.get("inputs", [])
                 if slot.get("link") is not None}
        values = strip_control_after_generate(node.get("widgets_values", []), widget_names[node["type"]])
        graph[str(node["id"])] = NodeDescription(node["type"], links, values)
    return graph


def strip_control_after_generate(values: list[Any], names: list[str]) -> tuple[Any, ...]:
    """Drop the extra value that follows each seed widget; fail if the list does not fit ``names``."""
    remaining = list(values)
    kept = []
    for name in names:
        if not remaining:
            raise ValueError(f"widgets_values {values} has no value for widget {name!r} (widgets: {names})")
        kept.append(remaining.pop(0))
        if name in SEED_INPUT_NAMES:
            control = remaining.pop(0) if remaining else None
            if control not in CONTROL_AFTER_GENERATE_VALUES:
                raise ValueError(f"widget {name!r} must be followed by one of {CONTROL_AFTER_GENERATE_VALUES}, "
                                 f"found {control!r} in {values}")
    if remaining:
        raise ValueError(f"widgets_values {values} has values left over after widgets {names}")
    return tuple(kept)


def widget_names_from_object_info(node_info: dict[str, Any]) -> list[str]:
    """Widget inputs of a node as ``GET /object_info`` describes it, in the order the browser shows them.

    The 2024 frontend adds an ``upload`` button widget after the required inputs of a node whose ``image``
    input is marked ``image_upload`` (``LoadImage``), and puts its value ("image") into the prompt.
    """
    names = []
    for section in ("required", "optional"):
        for name, spec in node_info["input"].get(section, {}).items():
            kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
            if (isinstance(kind, list) or kind in WIDGET_TYPES) and not options.get("forceInput", False):
                names.append(name)
        if section == "required" and _has_image_upload(node_info):
            names.append(UPLOAD_WIDGET_NAME)
    return names


def _has_image_upload(node_info: dict[str, Any]) -> bool:
    spec = node_info["input"].get("required", {}).get("image", [None])
    return len(spec) > 1 and isinstance(spec[1], dict) and spec[1].get("image_upload") is True
