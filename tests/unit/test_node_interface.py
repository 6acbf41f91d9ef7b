"""Every node as the UI shows it: a description, a category under WanMesh/, a tooltip on every input, and the
steps that keep sizes at multiples of 16 and lengths at 4k+1. No ComfyUI import: model lists are stubbed."""

from __future__ import annotations

import sys
import types

import pytest

CATEGORIES = {"WanMesh/loaders", "WanMesh/sampling", "WanMesh/vace", "WanMesh/image to video", "WanMesh/pool",
              "WanMesh/video"}


@pytest.fixture(scope="module")
def nodes():
    stub = types.ModuleType("folder_paths")
    stub.folder_names_and_paths = {"diffusion_models": ([], set()), "text_encoders": ([], set()), "vae": ([], set())}
    stub.get_filename_list = lambda name: []
    stub.get_full_path = lambda name, file: None
    saved = sys.modules.get("folder_paths")
    sys.modules["folder_paths"] = stub
    from wanmesh.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    yield NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    if saved is None:
        sys.modules.pop("folder_paths", None)
    else:
        sys.modules["folder_paths"] = saved


def test_every_node_has_a_description_category_and_name(nodes):
    classes, names = nodes
    for node_id, cls in classes.items():
        assert node_id.startswith("WanMesh") and names[node_id].startswith("WanMesh"), node_id
        assert getattr(cls, "DESCRIPTION", ""), f"{node_id} has no description"
        assert cls.CATEGORY in CATEGORIES, f"{node_id}: category {cls.CATEGORY!r}"


def test_every_input_has_a_tooltip_and_sizes_have_their_steps(nodes):
    classes, _ = nodes
    for node_id, cls in classes.items():
        spec = cls.INPUT_TYPES()
        for section in ("required", "optional"):
            for name, entry in spec.get(section, {}).items():
                options = entry[1] if len(entry) > 1 else {}
                assert options.get("tooltip"), f"{node_id}.{name} has no tooltip"
                if name in ("width", "height") and entry[0] == "INT":
                    assert options.get("step") == 16, f"{node_id}.{name}: a size widget must step by 16"
                if name == "length":
                    assert options.get("step") == 4 and options.get("min") == 1, f"{node_id}.{name}: 4k+1 frames"
