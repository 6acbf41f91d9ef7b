"""The UI-format example workflows and their API-format twins must describe the same graph.

No server is needed: the widget order is taken from the API file (whose order
``test_comfyui_server.py`` checks against the real node definitions).
"""

from __future__ import annotations

import json

import pytest
from workflow_graph import WORKFLOWS_DIR, api_widget_names, describe_api, describe_ui, is_link, load_workflow

API_WORKFLOWS = sorted(path.name for path in (WORKFLOWS_DIR / "api").glob("*.json"))


def test_every_api_workflow_has_a_ui_twin() -> None:
    ui_workflows = sorted(path.name for path in WORKFLOWS_DIR.glob("*.json"))
    assert API_WORKFLOWS, "workflows/api/ holds no workflow"
    assert ui_workflows == API_WORKFLOWS


@pytest.mark.parametrize("name", API_WORKFLOWS)
def test_ui_and_api_workflows_describe_the_same_graph(name: str) -> None:
    api = load_workflow(f"api/{name}")
    ui = load_workflow(name)
    widget_names = {node["class_type"]: api_widget_names(node) for node in api.values()}
    assert describe_ui(ui, widget_names) == describe_api(api)


@pytest.mark.parametrize("name", API_WORKFLOWS)
def test_ui_workflow_is_loadable(name: str) -> None:
    ui = load_workflow(name)
    assert ui["version"] == 0.4
    node_ids = [node["id"] for node in ui["nodes"]]
    assert len(set(node_ids)) == len(node_ids), "duplicate node ids"
    assert ui["last_node_id"] == max(node_ids)
    assert ui["last_link_id"] == max((link[0] for link in ui["links"]), default=0)
    for node in ui["nodes"]:
        assert {"id", "type", "pos", "size", "inputs", "outputs", "mode", "order"} <= node.keys(), node["id"]
    _assert_links_agree_with_slots(ui)


@pytest.mark.parametrize("name", API_WORKFLOWS)
def test_every_api_link_names_an_existing_node(name: str) -> None:
    prompt = load_workflow(f"api/{name}")
    dangling = [(node_id, value) for node_id, node in prompt.items() for value in node["inputs"].values()
                if is_link(value) and value[0] not in prompt]
    assert not dangling, f"links to missing nodes: {dangling}"


def _assert_links_agree_with_slots(ui: dict) -> None:
    """Each link appears on its source output and its target input, as LiteGraph needs to load it."""
    nodes = {node["id"]: node for node in ui["nodes"]}
    for link_id, source, source_slot, target, target_slot, link_type in ui["links"]:
        output = nodes[source]["outputs"][source_slot]
        target_input = nodes[target]["inputs"][target_slot]
        assert link_id in output["links"], f"link {link_id} missing from node {source} output {source_slot}"
        assert target_input["link"] == link_id, f"link {link_id} missing from node {target} input {target_slot}"
        assert output["type"] == target_input["type"] == link_type, json.dumps([output, target_input])


ALL_API_WORKFLOWS = sorted(str(path.relative_to(WORKFLOWS_DIR)) for path in WORKFLOWS_DIR.rglob("*.json")
                           if path.parent.name == "api")
VIDEO_NODE = "WanMeshSaveVideo"
VIDEO_FPS = 16
WORKFLOWS_WITH_PNG_FRAMES = ["api/t2v.json"]  # the one example that also saves its frames as images


def test_workflow_lists_find_the_examples() -> None:
    assert "api/t2v.json" in ALL_API_WORKFLOWS and "native/api/vace_native.json" in ALL_API_WORKFLOWS


@pytest.mark.parametrize("name", ALL_API_WORKFLOWS)
def test_workflow_ends_in_one_mp4_at_16_fps(name: str) -> None:
    """Each example saves the frames its decode makes as one MP4 at Wan's 16 fps."""
    prompt = load_workflow(name)
    videos = [node["inputs"] for node in prompt.values() if node["class_type"] == VIDEO_NODE]
    assert len(videos) == 1, f"{name} has {len(videos)} {VIDEO_NODE} nodes"
    assert videos[0]["fps"] == VIDEO_FPS, videos[0]
    source = prompt[videos[0]["images"][0]]["class_type"]
    decoders = ("VAEDecode", "WanMeshStreamSampler")  # the stream sampler decodes each chunk itself
    assert source.endswith(decoders), f"{name}: the video saves the output of {source}, not a VAE decode"


def test_only_t2v_also_saves_png_frames() -> None:
    with_png = [name for name in ALL_API_WORKFLOWS
                if any(node["class_type"] == "SaveImage" for node in load_workflow(name).values())]
    assert with_png == WORKFLOWS_WITH_PNG_FRAMES
    t2v = load_workflow("api/t2v.json")
    (png,) = [node for node in t2v.values() if node["class_type"] == "SaveImage"]
    (video,) = [node for node in t2v.values() if node["class_type"] == VIDEO_NODE]
    assert png["inputs"]["images"] == video["inputs"]["images"], "t2v's PNG and MP4 outputs save different frames"
