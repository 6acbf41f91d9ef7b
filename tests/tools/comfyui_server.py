"""Drive a real ComfyUI server for the tests: start, wait until ready, post prompts, follow them, stop.

Runs in the test process; the server is a child process. Only the standard
library, psutil and aiohttp (a ComfyUI dependency, for the ``/ws`` event
stream) are used, so the same helpers work from a test fixture and from a
shell (``python tests/tools/comfyui_server.py [--recent]`` starts a server on
the prepared 2024 or recent copy with the tiny models, for poking at it by hand).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import importlib.util
import json
import threading
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp
import psutil

# Old (2024) ComfyUI folder names first, the names today's ComfyUI uses second: the
# config must serve both, since nodes look up the new name and fall back to the old one.
MODEL_FOLDERS = {
    "unet": "diffusion_models/",
    "diffusion_models": "diffusion_models/",
    "clip": "text_encoders/",
    "text_encoders": "text_encoders/",
    "vae": "vae/",
    "loras": "loras/",
    "diffusers": "diffusers/",
    "clip_vision": "clip_vision/",
}
# A second transformer folder known only by the 2024 name: files there must be listed as well (today's ComfyUI
# maps "unet" onto its diffusion_models).
UNET_ONLY_FOLDER = "unet"
POLL_INTERVAL_S = 0.25
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# Input media of the example workflows (made by its make_inputs.py); LoadImage reads them from the input folder.
WORKFLOW_INPUTS_DIR = Path(__file__).resolve().parents[2] / "workflows" / "inputs"
# Test-only stand-ins for packages the recent ComfyUI imports but this CPU torch has no build of.
SHIMS_DIR = Path(__file__).resolve().parent / "comfyui_shims"
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform.startswith("linux") else None


class ComfyUIError(RuntimeError):
    """The server did not start, stopped answering, or a prompt did not finish in time."""


@dataclass
class PromptResult:
    """What ``/history`` says about a finished prompt."""

    prompt_id: str
    status: str
    outputs: dict[str, Any]
    messages: list[Any] = field(default_factory=list)

    def error_text(self) -> str:
        """All execution error details as one string (empty for a successful prompt)."""
        errors = [data for event, data in self.messages if event == "execution_error"]
        return "\n".join(json.dumps(error, indent=1) for error in errors)


@dataclass
class RejectedPrompt:
    """A prompt that ``POST /prompt`` refused at validation (HTTP 400)."""

    body: dict[str, Any]

    def error_text(self) -> str:
        return json.dumps(self.body, indent=1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def copy_workflow_inputs(input_dir: Path, source_dir: Path = WORKFLOW_INPUTS_DIR) -> list[Path]:
    """Copy every file of ``workflows/inputs/`` except its scripts into a server's input folder; return the copies."""
    input_dir.mkdir(parents=True, exist_ok=True)
    sources = sorted(path for path in source_dir.glob("*") if path.is_file() and path.suffix != ".py")
    return [Path(shutil.copy2(path, input_dir / path.name)) for path in sources]


def write_model_paths_config(models_dir: Path, config_path: Path) -> Path:
    """Write an ``extra_model_paths.yaml``-style file mapping ComfyUI's model folders into ``models_dir`` (and its
    ``unet`` folder as a second transformer folder under that name only)."""
    lines = ["wanmesh_tiny:", f"    base_path: {json.dumps(str(models_dir))}"]
    lines += [f"    {name}: {folder}" for name, folder in MODEL_FOLDERS.items()]
    lines += ["wanmesh_tiny_unet:", f"    base_path: {json.dumps(str(models_dir / UNET_ONLY_FOLDER))}", "    unet: ./"]
    config_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return config_path


class ComfyUIServer:
    """One ComfyUI server process (in its own process group) and an HTTP client for it."""

    def __init__(self, comfy_dir: Path, work_dir: Path, model_paths_config: Path | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        self.comfy_dir = comfy_dir
        self.output_dir = work_dir / "output"
        self.input_dir = work_dir / "input"
        self.log_path = work_dir / "comfyui.log"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._work_dir = work_dir
        self._model_paths_config = model_paths_config
        self._extra_env = extra_env or {}
        self._process: subprocess.Popen | None = None
        self._log_file = None
        # Every descendant ever seen: a worker pool replaced mid-run must be gone by the end as well.
        self._seen_descendants: set[psutil.Process] = set()

    def command(self) -> list[str]:
        # This 2024 ComfyUI has no --cache-none: tests vary the seed instead.
        command = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
                   "--output-directory", str(self.output_dir),
                   "--input-directory", str(self.input_dir),
                   "--temp-directory", str(self._work_dir), "--disable-auto-launch"]
        if self._model_paths_config is not None:
            command += ["--extra-model-paths-config", str(self._model_paths_config)]
        return command

    def environment(self) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **self._extra_env}

    def start(self, ready_timeout_s: float = 180.0) -> None:
        """Start the server and return once ``GET /object_info`` answers."""
        for folder in (self.output_dir, self.input_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log_path.open("wb")
        self._process = subprocess.Popen(self.command(), cwd=self.comfy_dir, env=self.environment(),
                                         stdin=subprocess.DEVNULL,
                                         stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_kill_when_parent_dies if _LIBC is not None else None)
        self.wait_ready(ready_timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ComfyUIError(f"ComfyUI exited with code {self._process.returncode} while starting:\n{self.log()}")
            try:
                self.get_json("/object_info", timeout_s=30.0)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(POLL_INTERVAL_S)
        raise ComfyUIError(f"ComfyUI did not answer /object_info within {timeout_s:.0f} s:\n{self.log()}")

    @property
    def pid(self) -> int:
        """The server's process id (the driver of the pools it starts)."""
        return self._process.pid

    def descendants(self) -> list[psutil.Process]:
        """The server's live child processes, recursively (worker pools included); all are remembered for ``stop``."""
        if self._process is None:
            return []
        try:
            found = psutil.Process(self._process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self._seen_descendants.update(found)
        return found

    def log(self) -> str:
        if not self.log_path.exists():
            return ""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def get_json(self, path: str, timeout_s: float = 30.0) -> Any:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout_s) as response:
            return json.loads(response.read())

    def post_json(self, path: str, body: Any, timeout_s: float = 30.0) -> tuple[int, Any]:
        """``POST`` ``body`` as JSON to ``path``: (HTTP status, the JSON answer), also for an error status."""
        request = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def submit(self, prompt: dict[str, Any], client_id: str | None = None) -> str | RejectedPrompt:
        """``POST /prompt``; return the prompt id, or the validation errors when the server refuses it.

        ``client_id`` names the ``/ws`` listener that gets the prompt's progress events (see ``listen``).
        """
        body = json.dumps({"prompt": prompt, "client_id": client_id or uuid.uuid4().hex}).encode()
        request = urllib.request.Request(self.base_url + "/prompt", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30.0) as response:
                return json.loads(response.read())["prompt_id"]
        except urllib.error.HTTPError as error:
            if error.code != 400:
                raise
            return RejectedPrompt(json.loads(error.read()))

    def wait_for(self, prompt_id: str, timeout_s: float) -> PromptResult:
        """Poll ``/history/<prompt_id>`` until the prompt has finished (successfully or not)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ComfyUIError(f"ComfyUI exited with code {self._process.returncode} during a prompt:\n"
                                   f"{self.log()}")
            self.descendants()
            entry = self.get_json(f"/history/{prompt_id}").get(prompt_id)
            if entry is not None and entry.get("status") is not None:
                status = entry["status"]
                return PromptResult(prompt_id, status.get("status_str", "unknown"), entry.get("outputs", {}),
                                    status.get("messages", []))
            time.sleep(POLL_INTERVAL_S)
        self.interrupt()
        raise ComfyUIError(f"prompt {prompt_id} did not finish within {timeout_s:.0f} s:\n{self.log()}")

    def run(self, prompt: dict[str, Any], timeout_s: float) -> PromptResult | RejectedPrompt:
        submitted = self.submit(prompt)
        if isinstance(submitted, RejectedPrompt):
            return submitted
        return self.wait_for(submitted, timeout_s)

    def listen(self, connect_timeout_s: float = 30.0) -> EventListener:
        """A connected ``/ws`` listener; pass its ``client_id`` to ``submit`` to receive that prompt's events."""
        listener = EventListener(self.base_url)
        try:
            listener.start(connect_timeout_s)
        except BaseException:
            listener.close()
            raise
        return listener

    def interrupt(self) -> None:
        """``POST /interrupt``: stop the prompt running now (queued prompts still run)."""
        try:
            urllib.request.urlopen(urllib.request.Request(self.base_url + "/interrupt", data=b""), timeout=10.0)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass

    def stop(self, grace_s: float = 30.0) -> list[str]:
        """Stop the server like Ctrl+C would; return the processes it left behind (which are then killed).

        "Left behind" covers every descendant seen while the server ran (``descendants``, called on each poll
        of a running prompt and here), not only those alive now: a worker of a pool that was replaced and
        then re-parented away from the server still counts.
        """
        if self._process is None:
            return []
        self.descendants()
        # is_running() also compares start times, so a reused pid is not mistaken for a seen process.
        descendants = [proc for proc in self._seen_descendants if proc.is_running()]
        process, self._process = self._process, None
        # Escalate: SIGINT lets ComfyUI and the worker pool clean up; a parent that ignores
        # SIGINT makes the child ignore it too, hence SIGTERM and SIGKILL after it.
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if process.poll() is not None:
                break
            process.send_signal(sig)
            try:
                process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
        _, left_behind = psutil.wait_procs(descendants, timeout=grace_s)
        described = [_describe(proc) for proc in left_behind]
        for proc in left_behind:
            _kill_quietly(proc)
        _kill_group_quietly(process.pid)
        self._log_file.close()
        return described


class RecentComfyUIServer(ComfyUIServer):
    """A server on the recent ComfyUI copy (0.33, ``build/comfyui-recent``), which needs more settings than 2024's.

    * ``--disable-api-nodes``: no partner-API nodes, and the frontend is told not to reach the internet. The
      frontend, workflow templates and embedded docs are served from their pip packages (ComfyUI fetches a
      frontend from the network only for a non-default ``--front-end-version``, which is never passed).
    * Its user folder and SQLite database live in the work folder, not in the ComfyUI copy that test
      sessions share. The user has opened ComfyUI before (``Comfy.TutorialCompleted``): for a new user today's
      frontend opens its template browser over the canvas on the first page load, and that dialog would cover
      the Queue button of whichever browser test comes first.
    * ``comfyui_shims/`` goes first on ``PYTHONPATH`` when no real torchaudio is installed: PyPI has no build
      of it for the CPU torch used here, and without it ComfyUI's audio node modules fail to import at
      start-up. Its torchvision imports were made optional when the copy was prepared (``prepare_comfyui.py``).
    """

    def command(self) -> list[str]:
        return super().command() + ["--disable-api-nodes", "--user-directory", str(self._user_dir),
                                    "--database-url", f"sqlite:///{self._work_dir / 'comfyui.db'}"]

    def environment(self) -> dict[str, str]:
        env = super().environment()
        if importlib.util.find_spec("torchaudio") is None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SHIMS_DIR), env.get("PYTHONPATH")]))
        return env

    def start(self, ready_timeout_s: float = 180.0) -> None:
        settings = self._user_dir / "default" / "comfy.settings.json"
        settings.parent.mkdir(parents=True, exist_ok=True)  # ComfyUI refuses a --user-directory that does not exist
        if not settings.is_file():
            settings.write_text(json.dumps({"Comfy.TutorialCompleted": True}))
        super().start(ready_timeout_s)

    @property
    def _user_dir(self) -> Path:
        return self._work_dir / "user"


@dataclass(frozen=True)
class ServerEvent:
    """One JSON message from ``/ws``: ``{"type": kind, "data": data}``."""

    kind: str
    data: dict[str, Any]


class EventListener:
    """A ``/ws?clientId=...`` websocket client collecting the server's JSON events in a background thread.

    This ComfyUI sends ``progress`` and ``executing`` only to the socket whose client id submitted the
    prompt, and ``execution_interrupted`` to every socket. A binary message is recorded as a ``binary`` event
    whose data holds ``event_type`` (ComfyUI's ``BinaryEventTypes``; 1 = a preview image) and ``payload``
    (the bytes after that header; for a preview image, a 4-byte format code then the image file).
    """

    def __init__(self, base_url: str) -> None:
        self.client_id = uuid.uuid4().hex
        self._url = base_url.replace("http://", "ws://", 1) + f"/ws?clientId={self.client_id}"
        self._events: list[ServerEvent] = []
        self._changed = threading.Condition()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._socket: aiohttp.ClientWebSocketResponse | None = None
        self._thread = threading.Thread(target=self._run, name="comfyui-ws", daemon=True)

    def start(self, connect_timeout_s: float) -> None:
        """Connect, and return once the server's greeting (a ``status`` event) has arrived."""
        self._thread.start()
        self.wait_for(lambda event: event.kind == "status", connect_timeout_s, "the /ws greeting")

    def events(self) -> list[ServerEvent]:
        with self._changed:
            return list(self._events)

    def wait_for(self, matches: Callable[[ServerEvent], bool], timeout_s: float, what: str) -> ServerEvent:
        """The first event (received so far or later) that ``matches``; ComfyUIError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                found = next((event for event in self._events if matches(event)), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if self._failure is not None or left <= 0 or not self._thread.is_alive():
                    kinds = [event.kind for event in self._events]
                    raise ComfyUIError(f"no {what} within {timeout_s:g} s (events so far: {kinds}; "
                                       f"listener failure: {self._failure!r})")
                self._changed.wait(min(left, POLL_INTERVAL_S))

    def close(self) -> None:
        loop, socket_ = self._loop, self._socket
        if loop is not None and socket_ is not None and not loop.is_closed():
            try:
                asyncio.run_coroutine_threadsafe(socket_.close(), loop).result(timeout=10.0)
            except (RuntimeError, TimeoutError, aiohttp.ClientError):
                pass  # the loop already ended: the socket is closed with it
        self._thread.join(timeout=10.0)

    def __enter__(self) -> EventListener:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self) -> None:
        try:
            asyncio.run(self._listen())
        except BaseException as error:  # handed to the test thread by wait_for
            self._failure = error
        finally:
            with self._changed:
                self._changed.notify_all()

    async def _listen(self) -> None:
        self._loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(self._url, heartbeat=None) as socket_:
                self._socket = socket_
                async for message in socket_:
                    if message.type == aiohttp.WSMsgType.TEXT:
                        self._record(json.loads(message.data))
                    elif message.type == aiohttp.WSMsgType.BINARY:
                        event_type = int.from_bytes(message.data[:4], "big")
                        self._record({"type": "binary", "data": {"event_type": event_type,
                                                                 "payload": message.data[4:]}})

    def _record(self, message: dict[str, Any]) -> None:
        with self._changed:
            self._events.append(ServerEvent(message["type"], message.get("data") or {}))
            self._changed.notify_all()


def _kill_when_parent_dies() -> None:
    """Runs in the child before exec: if the test process is killed outright, the server goes too."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid}: {' '.join(proc.cmdline())[:200]}"
    except psutil.Error:
        return f"pid {proc.pid}"


def _kill_quietly(proc: psutil.Process) -> None:
    try:
        proc.kill()
    except psutil.Error:
        pass


def _kill_group_quietly(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _serve_by_hand(recent: bool) -> None:
    """Start a server on the prepared 2024 (or recent) copy with tiny models, until Ctrl+C."""
    import tempfile

    from prepare_comfyui import prepare, REPO_ROOT

    comfy_dir = prepare(REPO_ROOT / "build", which="recent" if recent else "2024")
    work_dir = Path(tempfile.mkdtemp(prefix="wanmesh-comfyui-"))
    models = work_dir / "models"
    subprocess.run([sys.executable, "-c", "import sys; from wanmesh.parallel.cli import main; "
                    "sys.exit(main(sys.argv[1:]))", "make-tiny", str(models)], check=True)
    server_class = RecentComfyUIServer if recent else ComfyUIServer
    server = server_class(comfy_dir, work_dir, write_model_paths_config(models, work_dir / "extra_model_paths.yaml"))
    copy_workflow_inputs(server.input_dir)
    server.start()
    print(f"ComfyUI at {server.base_url}, log {server.log_path}; Ctrl+C stops it", flush=True)
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("left behind:", server.stop())


if __name__ == "__main__":
    _serve_by_hand(recent="--recent" in sys.argv[1:])
