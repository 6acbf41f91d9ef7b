"""Every UI-format workflow in ``workflows/`` loaded, checked and run in a real browser against a real ComfyUI.

Runs in the test process: a system Chromium (driven by playwright) opens the
page of the server that the ``comfyui_server`` fixture starts, loads each
workflow as a dropped file is loaded, compares the API prompt the frontend
builds with the workflow's twin in ``workflows/api/``, presses the Queue button
and follows the run to the files it writes and to the results the page shows
(today's frontend must play each saved MP4 in a <video> on its node). Every test runs
against both servers: the 2024 ComfyUI with its built-in frontend and ComfyUI 0.33
with today's. Screenshots of the loaded graph and of the finished run go to
``build/test-output/screenshots/``. A broken workflow (unknown node type,
absent model file) must be reported, so the checks are known to be able to fail.

Without a browser these tests skip, loudly; with ``CI=true`` they fail.
"""

from __future__ import annotations

import copy
import json
import os
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from browser import BrowserUnavailable, ComfyPage, LoadReport, launch_browser
from comfyui_server import ComfyUIServer
from PIL import Image
from workflow_graph import MAX_SEED, UPLOAD_WIDGET_NAME, WORKFLOWS_DIR, is_link, load_workflow
from test_comfyui_server import VIDEO_NODE

from wanmesh.parallel import read_video

WORKFLOW_NAMES = sorted(path.stem for path in WORKFLOWS_DIR.glob("*.json"))
# Workflows of native ComfyUI samplers on the WanMesh MODEL: they need a ComfyUI with native Wan support.
RECENT_ONLY_WORKFLOWS = ("native/t2v_native_ksampler", "native/t2v_native_auto_layout",
                         "native/wan22_native_ksampler_advanced", "native/wan22_lightx2v", "native/t2v_easycache",
                         "native/fun_control_native", "native/animate_native")
# Each server fixture named here runs every workflow: the 2024 ComfyUI with its built-in frontend, and ComfyUI
# 0.33 with today's frontend (comfyui-frontend-package).
SERVER_FIXTURES = ("comfyui_server", "recent_comfyui_server")
# Every workflow loads in both frontends and runs from today's; the 2024 frontend's Queue button runs these few (one
# per family: text, VACE with images, image-to-video), as its queue path is the same for every graph and each run
# costs a pool start and a sampling on the shared CI machine.
RUN_IN_2024_FRONTEND = ("t2v", "vace_r2v", "i2v")
# The 2024 frontend puts LoadImage's upload button value into the prompt (the API twins have it); today's does not.
FRONTENDS_WITHOUT_UPLOAD_IN_PROMPT = ("recent_comfyui_server",)
# Today's frontend plays video outputs in a <video> on the node; the 2024 one only lists the file.
FRONTENDS_THAT_PLAY_VIDEOS = ("recent_comfyui_server",)
SCREENSHOT_DIR = Path(__file__).resolve().parents[2] / "build" / "test-output" / "screenshots"
PROMPT_TIMEOUT_S = 420.0
UI_OUTPUT_TIMEOUT_S = 30.0
CHANGES_WHEN_QUEUED = "<seed that changes when queued>"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIXES = (".mp4",)


def pool_settings(name: str) -> tuple:
    """The WanMesh Pool inputs of a workflow's API twin (none for a workflow without a pool)."""
    pools = [node["inputs"] for node in load_workflow(api_twin(name)).values() if node["class_type"] == "WanMeshPool"]
    return tuple(sorted((key, str(value)) for pool in pools for key, value in pool.items()))


def grouped_by_pool(names: list[str]) -> list[str]:
    """``names`` with the workflows of the same pool settings next to each other: the server keeps a pool while its
    settings stay the same, so queued one after the other they start one pool per setting, not one per workflow."""
    return sorted(names, key=lambda name: (pool_settings(name), name))


@dataclass(frozen=True)
class ServerUnderTest:
    fixture_name: str
    server: ComfyUIServer

    def screenshot_path(self, workflow_name: str, stage: str) -> Path:
        """``<workflow>_<stage>.png`` for the first server, ``<workflow>_<fixture>_<stage>.png`` for others."""
        suffix = "" if self.fixture_name == SERVER_FIXTURES[0] else f"_{self.fixture_name}"
        return SCREENSHOT_DIR / f"{workflow_name.replace('/', '_')}{suffix}_{stage}.png"

    def skip_unless_it_runs(self, name: str) -> None:
        if name in RECENT_ONLY_WORKFLOWS and self.fixture_name != "recent_comfyui_server":
            pytest.skip(f"{name} uses native Wan nodes, which the 2024 ComfyUI does not have")

    def skip_unless_queued_here(self, name: str) -> None:
        self.skip_unless_it_runs(name)
        if self.fixture_name != "recent_comfyui_server" and name not in RUN_IN_2024_FRONTEND:
            pytest.skip(f"{name} is queued from today's frontend; the 2024 one queues {', '.join(RUN_IN_2024_FRONTEND)}")

    def expected_prompt(self, name: str) -> dict[str, Any]:
        """``workflows/api/<name>.json`` as this server's frontend builds it: without LoadImage's ``upload`` input
        where the frontend leaves it out (the only difference between the two frontends' prompts)."""
        prompt = load_workflow(api_twin(name))
        if self.fixture_name in FRONTENDS_WITHOUT_UPLOAD_IN_PROMPT:
            for node in prompt.values():
                if node["class_type"] == "LoadImage":
                    node["inputs"].pop(UPLOAD_WIDGET_NAME, None)
        return prompt

    @property
    def plays_videos(self) -> bool:
        return self.fixture_name in FRONTENDS_THAT_PLAY_VIDEOS


def api_twin(name: str) -> str:
    """``workflows/<folder>/api/<name>.json``: the API twin of ``<folder>/<name>``."""
    folder, _, stem = name.rpartition("/")
    return f"{folder}/api/{stem}.json" if folder else f"api/{stem}.json"


def running_in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def no_browser(reason: str) -> None:
    if running_in_ci():
        pytest.fail(f"CI=true and no browser for the browser tests: {reason}", pytrace=False)
    pytest.skip(f"!!! NO BROWSER: the browser workflow tests did NOT run: {reason}")


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """One headless system Chromium shared by the module's tests (each test opens its own context)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as error:
        no_browser(f"the playwright package is missing ({error}); 'pip install playwright'")
    try:
        playwright = sync_playwright().start()
    except Exception as error:  # its driver (a bundled node.js) did not start
        no_browser(f"playwright did not start: {error}")
    try:
        browser = launch_browser(playwright)
    except BrowserUnavailable as error:
        playwright.stop()
        no_browser(str(error))
    yield browser
    browser.close()
    playwright.stop()


@pytest.fixture(scope="module", params=SERVER_FIXTURES)
def server_under_test(request: pytest.FixtureRequest) -> ServerUnderTest:
    return ServerUnderTest(request.param, request.getfixturevalue(request.param))


def frozen(value: Any) -> Any:
    """A hashable form of a JSON value in which ``False`` and ``0`` differ but ``5`` and ``5.0`` do not."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (type(value).__name__, value)
    if isinstance(value, (int, float)):
        return ("number", float(value))
    if isinstance(value, list):
        return ("list", tuple(frozen(item) for item in value))
    return ("object", tuple(sorted((key, frozen(item)) for key, item in value.items())))


def graph_shape(prompt: dict[str, Any], changing_seeds: set[tuple[str, str]]) -> Counter:
    """The prompt's nodes, each described by its class, widget values and (recursively) its input nodes.

    Node ids do not appear, so two prompts that differ only in their ids have the same shape. Seeds
    listed in ``changing_seeds`` as (class type, input name) compare equal whatever their value.
    """
    shapes: dict[str, Any] = {}
    in_progress: set[str] = set()

    def shape_of(node_id: str) -> Any:
        if node_id not in prompt:
            raise AssertionError(f"a link points at node {node_id!r}, which the prompt lacks: {sorted(prompt)}")
        if node_id in in_progress:
            raise AssertionError(f"the prompt's links form a cycle through node {node_id!r}")
        if node_id not in shapes:
            in_progress.add(node_id)
            node = prompt[node_id]
            widgets, links = [], []
            for name, value in node["inputs"].items():
                if is_link(value):
                    links.append((name, shape_of(value[0]), value[1]))
                elif (node["class_type"], name) in changing_seeds:
                    widgets.append((name, CHANGES_WHEN_QUEUED))
                else:
                    widgets.append((name, frozen(value)))
            shapes[node_id] = (node["class_type"], tuple(sorted(widgets)), tuple(sorted(links)))
            in_progress.discard(node_id)
        return shapes[node_id]

    return Counter(shape_of(node_id) for node_id in prompt)


def assert_same_graph(actual: dict[str, Any], expected: dict[str, Any], changing_seeds: set[tuple[str, str]],
                      what: str) -> None:
    assert graph_shape(actual, changing_seeds) == graph_shape(expected, changing_seeds), (
        f"{what} differs:\n--- actual ---\n{json.dumps(actual, indent=1)}\n"
        f"--- expected ---\n{json.dumps(expected, indent=1)}")


def assert_loaded_cleanly(report: LoadReport, workflow: dict[str, Any]) -> None:
    assert not report.missing_node_types, f"the frontend reported missing node types: {report.missing_node_types}"
    assert not report.missing_nodes_dialog_shown, "the frontend shows its missing node types dialog"
    assert not report.unregistered_node_types, f"node types unknown to LiteGraph: {report.unregistered_node_types}"
    assert not report.invalid_widgets, f"widget values the frontend cannot show: {report.invalid_widgets}"
    assert not report.dialogs, f"the frontend opened dialogs: {report.dialogs}"
    assert (report.node_count, report.link_count) == (len(workflow["nodes"]), len(workflow["links"])), (
        f"the graph shown has {report.node_count} nodes and {report.link_count} links, the workflow "
        f"{len(workflow['nodes'])} and {len(workflow['links'])}")


def load_in_browser(chromium: Any, server: ComfyUIServer, name: str) -> tuple[ComfyPage, LoadReport]:
    comfy = ComfyPage.open(chromium, server.base_url)
    try:
        report = comfy.load_workflow(load_workflow(f"{name}.json"))
    except BaseException:
        comfy.close()
        raise
    return comfy, report


def files_listed_in_history(outputs: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """``{node id: [{"filename", "subfolder", "type"}, ...]}`` for every output node that saved files."""
    listed = {}
    for node_id, node_output in outputs.items():
        files = [item for items in node_output.values() if isinstance(items, list)
                 for item in items if isinstance(item, dict) and "filename" in item]
        if files:
            listed[node_id] = files
    return listed


def assert_outputs_written_and_shown(comfy: ComfyPage, under_test: ServerUnderTest, outputs: dict[str, Any],
                                     prompt: dict[str, Any]) -> None:
    """Every file ``/history`` lists is in the output folder (images readable, videos decodable) and shown on its
    node in the page; where the frontend plays videos, each WanMesh Save Video node plays its MP4 in a <video>."""
    server = under_test.server
    listed = files_listed_in_history(outputs)
    assert listed, f"/history lists no output files: {outputs}"
    for node_id, files in listed.items():
        paths = [server.output_dir / item["subfolder"] / item["filename"] for item in files]
        missing = [str(path) for path in paths if not path.is_file()]
        assert not missing, f"/history lists files that were not written: {missing}"
        empty = [str(path) for path in paths if path.stat().st_size == 0]
        assert not empty, f"empty output files: {empty}"
        for path in (path for path in paths if path.suffix.lower() in IMAGE_SUFFIXES):
            with Image.open(path) as image:
                image.verify()
        videos = [path for path in paths if path.suffix.lower() in VIDEO_SUFFIXES]
        for path in videos:
            assert len(read_video(path)) > 0, f"{path.name} holds no frame"
        shown = comfy.wait_for_ui_output_files(node_id, UI_OUTPUT_TIMEOUT_S)
        assert shown == [item["filename"] for item in files], f"node {node_id} shows {shown}, /history lists {files}"
        if not videos:
            comfy.wait_for_output_images_drawn(node_id, UI_OUTPUT_TIMEOUT_S)
        elif under_test.plays_videos and prompt[node_id]["class_type"] == VIDEO_NODE:
            assert_video_plays(comfy, node_id, videos)


def assert_video_plays(comfy: ComfyPage, node_id: str, videos: list[Path]) -> None:
    """The node shows a <video> of its (one) MP4, decoded by the browser at the file's frame size."""
    assert len(videos) == 1, f"node {node_id} saved {len(videos)} videos: {videos}"
    frames = read_video(videos[0])
    shown = comfy.wait_for_video_shown(node_id, UI_OUTPUT_TIMEOUT_S)
    expected = {"filename": videos[0].name, "width": frames.shape[2], "height": frames.shape[1]}
    assert shown is not None and shown["ready_state"] >= 2, f"node {node_id} shows no playable video: {shown}"
    assert {key: shown[key] for key in expected} == expected, f"node {node_id} shows {shown}, expected {expected}"


def renumber_nodes(prompt: dict[str, Any], offset: int) -> dict[str, Any]:
    """The prompt with every node id (and every link to it) moved up by ``offset``."""
    def moved(value: Any) -> Any:
        return [str(int(value[0]) + offset), value[1]] if is_link(value) else value
    return {str(int(node_id) + offset): {**node, "inputs": {name: moved(value) for name, value in inputs.items()}}
            for node_id, node in prompt.items() for inputs in [node["inputs"]]}


def dependents(prompt: dict[str, Any], node_id: str) -> set[str]:
    """The nodes that take ``node_id``'s outputs, directly or through other nodes."""
    found, frontier = set(), {node_id}
    while frontier:
        frontier = {other for other, node in prompt.items() if other not in found
                    and any(is_link(value) and value[0] in frontier for value in node["inputs"].values())}
        found |= frontier
    return found


def other_value(value: Any) -> Any:
    """A JSON value of the same kind that differs from ``value``."""
    if isinstance(value, bool):
        return not value
    return f"{value}x" if isinstance(value, str) else value + 1


def test_graph_shape_ignores_node_ids_and_nothing_else() -> None:
    prompt = load_workflow(f"api/{WORKFLOW_NAMES[0]}.json")
    shape = graph_shape(prompt, set())
    assert graph_shape(renumber_nodes(prompt, offset=100), set()) == shape
    for node_id, node in prompt.items():
        for name, value in node["inputs"].items():
            changed = copy.deepcopy(prompt)
            if is_link(value):  # the same output slot of another node that does not depend on this one
                unrelated = set(prompt) - dependents(prompt, node_id) - {node_id, value[0]}
                if not unrelated:
                    continue
                changed[node_id]["inputs"][name] = [min(unrelated), value[1]]
            else:
                changed[node_id]["inputs"][name] = other_value(value)
            assert graph_shape(changed, set()) != shape, f"changing node {node_id} input {name} went unnoticed"
    assert graph_shape({"1": {"class_type": "A", "inputs": {"on": False}}}, set()) != graph_shape(
        {"1": {"class_type": "A", "inputs": {"on": 0}}}, set())
    assert graph_shape({"1": {"class_type": "A", "inputs": {"cfg": 5}}}, set()) == graph_shape(
        {"1": {"class_type": "A", "inputs": {"cfg": 5.0}}}, set())


def test_graph_shape_ignores_only_the_seeds_it_is_told_change() -> None:
    first = {"1": {"class_type": "Sampler", "inputs": {"seed": 1, "steps": 4}}}
    reseeded = {"1": {"class_type": "Sampler", "inputs": {"seed": 2, "steps": 4}}}
    assert graph_shape(first, {("Sampler", "seed")}) == graph_shape(reseeded, {("Sampler", "seed")})
    assert graph_shape(first, {("Other", "seed")}) != graph_shape(reseeded, {("Other", "seed")})
    restepped = {"1": {"class_type": "Sampler", "inputs": {"seed": 2, "steps": 5}}}
    assert graph_shape(first, {("Sampler", "seed")}) != graph_shape(restepped, {("Sampler", "seed")})


def test_graph_shape_reports_cycles() -> None:
    cyclic = {"1": {"class_type": "A", "inputs": {"x": ["2", 0]}}, "2": {"class_type": "B", "inputs": {"y": ["1", 0]}}}
    with pytest.raises(AssertionError, match="cycle"):
        graph_shape(cyclic, set())


def test_browser_reports_missing_nodes_bad_widget_values_and_changing_seeds(
        chromium: Any, server_under_test: ServerUnderTest) -> None:
    """The load checks can fail: a workflow with an unknown node type, and one with an absent model file and a
    changing seed, are reported (one fault per workflow: the newest frontend names a missing node only when it is
    the one error it shows)."""
    workflow = load_workflow("t2v.json")
    unknown_node, bad_values = copy.deepcopy(workflow), copy.deepcopy(workflow)
    next(node for node in unknown_node["nodes"] if node["type"] == "WanMeshEmptyLatent")["type"] = "WanMeshNoSuchNode"
    nodes = {node["type"]: node for node in bad_values["nodes"]}
    nodes["WanMeshModelLoader"]["widgets_values"][0] = "absent_model.safetensors"
    sampler_values = nodes["WanMeshSampler"]["widgets_values"]
    sampler_values[sampler_values.index("fixed")] = "randomize"
    with ComfyPage.open(chromium, server_under_test.server.base_url) as comfy:
        report = comfy.load_workflow(unknown_node)
        assert report.missing_node_types == ["WanMeshNoSuchNode"]
        assert report.missing_nodes_dialog_shown
        assert report.unregistered_node_types == ["WanMeshNoSuchNode"]
        with pytest.raises(AssertionError):
            assert_loaded_cleanly(report, workflow)
    with ComfyPage.open(chromium, server_under_test.server.base_url) as comfy:
        report = comfy.load_workflow(bad_values)
        assert len(report.invalid_widgets) == 1 and "absent_model.safetensors" in report.invalid_widgets[0]
        assert report.changing_seeds == [("WanMeshSampler", "seed")]
        with pytest.raises(AssertionError):
            assert_loaded_cleanly(report, workflow)
        with pytest.raises(AssertionError):
            assert_same_graph(comfy.graph_to_prompt(), server_under_test.expected_prompt(WORKFLOW_NAMES[0]),
                              set(report.changing_seeds), "the broken workflow")


@pytest.mark.parametrize("name", WORKFLOW_NAMES + list(RECENT_ONLY_WORKFLOWS))
def test_workflow_loads_in_the_browser_as_its_api_twin(chromium: Any, server_under_test: ServerUnderTest,
                                                        name: str) -> None:
    """No missing nodes, bad widgets, dialogs or console errors; graphToPrompt equals workflows/api/<name>.json."""
    server_under_test.skip_unless_it_runs(name)
    workflow = load_workflow(f"{name}.json")
    comfy, report = load_in_browser(chromium, server_under_test.server, name)
    with comfy:
        comfy.fit_view()
        comfy.screenshot(server_under_test.screenshot_path(name, "loaded"))
        assert_loaded_cleanly(report, workflow)
        prompt = comfy.graph_to_prompt()
        assert_same_graph(prompt, server_under_test.expected_prompt(name), set(report.changing_seeds),
                          f"the frontend's graphToPrompt output for workflows/{name}.json")
        assert not comfy.errors, f"the page reported errors: {comfy.errors}"


@pytest.mark.parametrize("name", grouped_by_pool(WORKFLOW_NAMES + list(RECENT_ONLY_WORKFLOWS)))
def test_workflow_queued_from_the_browser_runs_and_saves_its_outputs(chromium: Any,
                                                                     server_under_test: ServerUnderTest,
                                                                     name: str) -> None:
    """The Queue button posts the API twin; the run succeeds; every file /history lists exists and is shown."""
    server_under_test.skip_unless_queued_here(name)
    server = server_under_test.server
    comfy, report = load_in_browser(chromium, server, name)
    with comfy:
        assert_loaded_cleanly(report, load_workflow(f"{name}.json"))
        comfy.fit_view()
        changing_seeds = set(report.changing_seeds)
        before_queue = comfy.graph_to_prompt()

        queued = comfy.queue_from_ui()
        assert queued.http_status == 200, f"POST /prompt answered {queued.http_status}: {queued.answer}"
        assert not queued.answer.get("node_errors"), f"node errors: {queued.answer['node_errors']}"
        assert_same_graph(queued.prompt, before_queue, changing_seeds, "the prompt the Queue button posted")
        assert_same_graph(queued.prompt, server_under_test.expected_prompt(name), changing_seeds,
                          "the prompt the Queue button posted (against the API twin)")

        result = server.wait_for(queued.prompt_id, PROMPT_TIMEOUT_S)
        try:
            assert result.status == "success", (f"prompt failed:\n{result.error_text()}\n"
                                                f"--- server log ---\n{server.log()}")
            assert_outputs_written_and_shown(comfy, server_under_test, result.outputs, queued.prompt)
        finally:  # the finished run, or the error the page shows
            comfy.screenshot(server_under_test.screenshot_path(name, "done"))
        assert not comfy.errors, f"the page reported errors: {comfy.errors}"


LIVE_PROMPT = "the fox turns into a flock of birds"
_SET_STREAM_SEED_JS = """(seed) => {
    const node = app.graph._nodes.find((n) => n.comfyClass === "WanMeshStreamSampler");
    node.widgets.find((w) => w.name === "seed").value = seed;
}"""
_SEND_LIVE_PROMPT_JS = """(text) => {
    const node = app.graph._nodes.find((n) => n.comfyClass === "WanMeshStreamSampler");
    node.widgets.find((w) => w.name === "live_prompt").value = text;
    node.widgets.find((w) => w.name === "send live prompt").callback();
}"""
_LIVE_STATUS_JS = """() => app.graph._nodes.find((n) => n.comfyClass === "WanMeshStreamSampler")
    .widgets.find((w) => w.name === "live_status").value"""


def saved_video(server: ComfyUIServer, outputs: dict[str, Any], prompt: dict[str, Any]) -> Path:
    (save_id,) = [node_id for node_id, node in prompt.items() if node["class_type"] == "WanMeshSaveVideo"]
    (item,) = files_listed_in_history({save_id: outputs[save_id]})[save_id]
    return server.output_dir / item["subfolder"] / item["filename"]


def test_a_live_prompt_sent_from_the_stream_sampler_switches_the_stream(chromium: Any,
                                                                        recent_comfyui_server: ComfyUIServer) -> None:
    """stream_t2v in today's frontend: a prompt typed into the WanMesh Stream Sampler's live_prompt and sent with its
    button right after Queue applies at chunk 1 (the node says so), and the video equals the API run of the same
    workflow with a WanMesh Prompt Switch to that text at chunk 1 chained before its own switch."""
    server = recent_comfyui_server
    comfy, report = load_in_browser(chromium, server, "stream_t2v")
    with comfy:
        assert_loaded_cleanly(report, load_workflow("stream_t2v.json"))
        # a seed of its own: ComfyUI would answer the workflow's own seed from its cache without streaming
        comfy.page.evaluate(_SET_STREAM_SEED_JS, random.randint(0, MAX_SEED))
        queued = comfy.queue_from_ui()
        assert queued.http_status == 200, f"POST /prompt answered {queued.http_status}: {queued.answer}"
        comfy.page.evaluate(_SEND_LIVE_PROMPT_JS, LIVE_PROMPT)
        comfy.page.wait_for_function(f"() => !({_LIVE_STATUS_JS})().startsWith('waiting') && ({_LIVE_STATUS_JS})()",
                                     timeout=PROMPT_TIMEOUT_S * 1000)
        status = comfy.page.evaluate(_LIVE_STATUS_JS)
        result = server.wait_for(queued.prompt_id, PROMPT_TIMEOUT_S)
        assert result.status == "success", f"{result.error_text()}\n--- server log ---\n{server.log()}"
        assert status == "switched at chunk 1", status
        assert not comfy.errors, f"the page reported errors: {comfy.errors}"

    scheduled = copy.deepcopy(queued.prompt)
    (sampler_id,) = [node_id for node_id, node in scheduled.items() if node["class_type"] == "WanMeshStreamSampler"]
    sampler_inputs = scheduled[sampler_id]["inputs"]
    encoder = sampler_inputs["text_encoder"]
    scheduled["live_text"] = {"class_type": "WanMeshTextEncode", "inputs": {"text_encoder": encoder,
                                                                            "text": LIVE_PROMPT}}
    scheduled["live_switch"] = {"class_type": "WanMeshPromptSwitch", "inputs": {"positive": ["live_text", 0],
                                                                                "chunk": 1}}
    own_switch = sampler_inputs["prompt_switches"][0]
    scheduled[own_switch]["inputs"]["switches"] = ["live_switch", 0]
    scheduled_result = server.run(scheduled, PROMPT_TIMEOUT_S)
    assert scheduled_result.status == "success", scheduled_result.error_text()
    live_frames = read_video(saved_video(server, result.outputs, queued.prompt)).float()
    scheduled_frames = read_video(saved_video(server, scheduled_result.outputs, scheduled)).float()
    assert live_frames.shape == scheduled_frames.shape
    # frames in [0, 1]. The two runs' latents agree to float rounding, but H.264 may encode a few pixels of nearly
    # equal frames differently (up to 0.1 seen), so the mean is compared: within two steps of 8-bit video. A switch
    # at another chunk differs by far more (the API test compares the latents themselves).
    difference = (live_frames - scheduled_frames).abs().mean()
    assert difference <= 2 / 255, f"the live switch is not the scheduled one at chunk 1 (mean difference {difference})"


_SET_STREAM_WINDOW_JS = """([seed, window, sink, reanchor]) => {
    const node = app.graph._nodes.find((n) => n.comfyClass === "WanMeshStreamSampler");
    const set = (name, value) => { node.widgets.find((w) => w.name === name).value = value; };
    set("seed", seed); set("kv_window", window); set("sink", sink); set("reanchor", reanchor);
}"""


def test_a_reanchored_window_set_in_the_stream_sampler_reaches_the_pool(chromium: Any,
                                                                        recent_comfyui_server: ComfyUIServer) -> None:
    """stream_t2v in today's frontend with kv_window 3, sink 1 and reanchor switched on in the WanMesh Stream
    Sampler's widgets: the queued prompt carries them, the run succeeds, and its video differs from the same prompt
    with reanchor off (the window rolls in the workflow's 5 latent frames, so re-anchoring changes chunks 1 and 2)."""
    server = recent_comfyui_server
    comfy, report = load_in_browser(chromium, server, "stream_t2v")
    with comfy:
        assert_loaded_cleanly(report, load_workflow("stream_t2v.json"))
        comfy.page.evaluate(_SET_STREAM_WINDOW_JS, [random.randint(0, MAX_SEED), 3, 1, True])
        queued = comfy.queue_from_ui()
        assert queued.http_status == 200, f"POST /prompt answered {queued.http_status}: {queued.answer}"
        result = server.wait_for(queued.prompt_id, PROMPT_TIMEOUT_S)
        assert result.status == "success", f"{result.error_text()}\n--- server log ---\n{server.log()}"
        assert not comfy.errors, f"the page reported errors: {comfy.errors}"
    (sampler_id,) = [node_id for node_id, node in queued.prompt.items() if node["class_type"] == "WanMeshStreamSampler"]
    inputs = queued.prompt[sampler_id]["inputs"]
    assert (inputs["kv_window"], inputs["sink"], inputs["reanchor"]) == (3, 1, True), inputs
    plain = copy.deepcopy(queued.prompt)
    plain[sampler_id]["inputs"]["reanchor"] = False
    plain_result = server.run(plain, PROMPT_TIMEOUT_S)
    assert plain_result.status == "success", plain_result.error_text()
    anchored_frames = read_video(saved_video(server, result.outputs, queued.prompt)).float()
    plain_frames = read_video(saved_video(server, plain_result.outputs, plain)).float()
    assert anchored_frames.shape == plain_frames.shape
    assert (anchored_frames - plain_frames).abs().max() > 0.05, "re-anchoring set in the browser changed nothing"
