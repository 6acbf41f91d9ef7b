"""Build a ComfyUI workflow once and write it in both formats (runs in a maintainer's shell or a test process).

A ``WorkflowBuilder`` takes ComfyUI's ``GET /object_info`` answer, so widget
order, defaults and slot types come from the real node definitions, never from
a copy kept here. Nodes are added with named widget values and named links;
``ui()`` gives the UI format (what dropping the file into ComfyUI loads) and
``api()`` the API format (what the frontend posts to ``/prompt``), with the
same node ids. ``make_workflows.py`` describes the example workflows with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workflow_graph import SEED_INPUT_NAMES, UPLOAD_WIDGET_NAME, WIDGET_TYPES

TEXT_NODE_SIZE = [360, 150]
IMAGE_NODE_HEIGHT = 320  # LoadImage, SaveImage, WanMeshSaveVideo: room for the picture or the video
PICTURE_NODES = ("LoadImage", "SaveImage", "WanMeshSaveVideo")
NODE_WIDTH = 320
ROW_HEIGHTS = {"title": 30, "slot": 22, "widget": 26}
SEED_CONTROL = "fixed"  # the "control after generate" value written after each seed (the examples are repeatable)
EMPTY_WIDGET_VALUES = {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}
UI_FORMAT_VERSION = 0.4
VIEW = {"ds": {"scale": 0.7, "offset": [0, 0]}}


def is_widget(spec: list[Any]) -> bool:
    """An input the frontend shows as a widget (a value typed in the node), not a socket."""
    options = spec[1] if len(spec) > 1 else {}
    return (isinstance(spec[0], list) or spec[0] in WIDGET_TYPES) and not options.get("forceInput", False)


def default_of(spec: list[Any]) -> Any:
    """The value the frontend puts in a new widget: the declared default, else the first choice, else empty."""
    options = spec[1] if len(spec) > 1 else {}
    if "default" in options:
        return options["default"]
    if spec[0] == "COMBO":
        return options["options"][0]
    return spec[0][0] if isinstance(spec[0], list) else EMPTY_WIDGET_VALUES[spec[0]]


@dataclass
class Node:
    id: int
    type: str
    pos: list[int]
    widgets: dict[str, Any]
    links: dict[str, tuple[int, int]]  # input name -> (source node id, output slot)
    title: str | None = None
    size: list[int] | None = None


@dataclass
class WorkflowBuilder:
    """One workflow's nodes; ``upload_in_prompt``: the frontend the API twin is for puts LoadImage's upload
    button value into the prompt (the 2024 frontend does, today's does not)."""

    object_info: dict[str, Any]
    upload_in_prompt: bool = True
    nodes: list[Node] = field(default_factory=list)

    def node(self, class_type: str, pos: list[int], widgets: dict[str, Any] | None = None,
             links: dict[str, tuple[int, int]] | None = None, title: str | None = None,
             size: list[int] | None = None) -> int:
        """Add a node (ids count up from 1 in the order added) and return its id."""
        if class_type not in self.object_info:
            raise ValueError(f"node type {class_type!r} is not in /object_info; the server must load it")
        node = Node(len(self.nodes) + 1, class_type, pos, dict(widgets or {}), dict(links or {}), title, size)
        known = {name for name, _ in self._inputs(class_type, for_prompt=False)}
        unknown = sorted((node.widgets.keys() | node.links.keys()) - known)
        if unknown:
            raise ValueError(f"{class_type} has no inputs {unknown}; it has {sorted(known)}")
        self.nodes.append(node)
        return node.id

    def api(self) -> dict[str, Any]:
        """The API-format prompt: named inputs, links as ``[source id, slot]``, widgets in declared order."""
        prompt = {}
        for node in self.nodes:
            inputs = {}
            for name, spec in self._inputs(node.type, for_prompt=True):
                if name in node.links:
                    source, slot = node.links[name]
                    inputs[name] = [str(source), slot]
                elif is_widget(spec):
                    inputs[name] = node.widgets[name] if name in node.widgets else default_of(spec)
            title = node.title or self.object_info[node.type]["display_name"]
            prompt[str(node.id)] = {"inputs": inputs, "class_type": node.type, "_meta": {"title": title}}
        return prompt

    def ui(self) -> dict[str, Any]:
        """The UI-format workflow: positional widget values, sockets, and a links table in target-node order."""
        order = self._execution_order()
        ui_nodes = {node.id: self._ui_node(node, order[node.id]) for node in self.nodes}
        links = []
        for node in self.nodes:
            for slot_index, slot in enumerate(ui_nodes[node.id]["inputs"]):
                if slot["name"] not in node.links:
                    continue
                source, source_slot = node.links[slot["name"]]
                output = ui_nodes[source]["outputs"][source_slot]
                link_id = len(links) + 1
                slot["link"] = link_id
                output["links"].append(link_id)
                links.append([link_id, source, source_slot, node.id, slot_index, slot["type"]])
        return {"last_node_id": max(ui_nodes), "last_link_id": len(links), "nodes": list(ui_nodes.values()),
                "links": links, "groups": [], "config": {}, "extra": VIEW, "version": UI_FORMAT_VERSION}

    def write(self, folder: Path, name: str) -> list[Path]:
        """Write ``<folder>/<name>.json`` (UI) and ``<folder>/api/<name>.json`` (API); return both paths."""
        paths = [folder / f"{name}.json", folder / "api" / f"{name}.json"]
        for path, content in zip(paths, (self.ui(), self.api())):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
        return paths

    def _inputs(self, class_type: str, for_prompt: bool) -> list[tuple[str, list[Any]]]:
        """Declared inputs in the frontend's widget order, with LoadImage's upload button after the required ones
        (in the UI always, in the prompt only when ``upload_in_prompt``)."""
        declared = self.object_info[class_type]["input"]
        required = list(declared.get("required", {}).items())
        image = declared.get("required", {}).get("image")
        has_upload = image is not None and len(image) > 1 and image[1].get("image_upload") is True
        if has_upload and (self.upload_in_prompt or not for_prompt):
            required.append((UPLOAD_WIDGET_NAME, [["image"]]))
        return required + list(declared.get("optional", {}).items())

    def _execution_order(self) -> dict[int, int]:
        """Node id -> position in an order where every node comes after the nodes it takes inputs from."""
        order: dict[int, int] = {}
        while len(order) < len(self.nodes):
            ready = [node for node in self.nodes if node.id not in order
                     and all(source in order for source, _ in node.links.values())]
            if not ready:
                raise ValueError("the workflow's links form a cycle")
            for node in ready:
                order[node.id] = len(order)
        return order

    def _ui_node(self, node: Node, order: int) -> dict[str, Any]:
        info = self.object_info[node.type]
        sockets, converted, widget_values = [], [], []
        for name, spec in self._inputs(node.type, for_prompt=False):
            if not is_widget(spec):
                sockets.append({"name": name, "type": spec[0], "link": None})
            elif name in node.links:  # a widget fed by a link: a socket that remembers its widget
                converted.append({"name": name, "type": spec[0], "link": None, "widget": {"name": name}})
            else:
                widget_values.append(node.widgets[name] if name in node.widgets else default_of(spec))
                if name in SEED_INPUT_NAMES:
                    widget_values.append(SEED_CONTROL)
        outputs = [{"name": out_name, "type": out_type, "links": [], "slot_index": slot}
                   for slot, (out_type, out_name) in enumerate(zip(info["output"], info["output_name"]))]
        ui_node = {"id": node.id, "type": node.type, "pos": node.pos,
                   "size": node.size or self._default_size(node.type, len(sockets), len(outputs), len(widget_values)),
                   "flags": {}, "order": order, "mode": 0, "inputs": sockets + converted, "outputs": outputs,
                   "properties": {"Node name for S&R": node.type}}
        if node.title:
            ui_node["title"] = node.title
        ui_node["widgets_values"] = widget_values
        return ui_node

    @staticmethod
    def _default_size(class_type: str, sockets: int, outputs: int, widgets: int) -> list[int]:
        if class_type in PICTURE_NODES:
            return [NODE_WIDTH, IMAGE_NODE_HEIGHT]
        height = ROW_HEIGHTS["title"] + ROW_HEIGHTS["slot"] * max(sockets, outputs) + ROW_HEIGHTS["widget"] * widgets
        return [NODE_WIDTH, height]
