"""ComfyUI ending (Ctrl-C) while a WanMesh prompt runs; runs in the ComfyUI process at interpreter exit.

ComfyUI runs prompts in a daemon thread and ends its main thread on Ctrl-C; the interpreter then tears down
while that thread may still be sampling. At exit this hook (registered after the pool's own exit handler, so it
runs first) asks the running pool call to stop its workers in its own thread (``WorkerPool.stop_running_call``:
the node error then says the pool was stopped because the server is shutting down) and waits until ComfyUI's
queue has finished that prompt, so the interpreter is not torn down under a thread that is still reporting it.
The pool's exit handler then finds nothing running.
"""

from __future__ import annotations

import atexit
import sys
import time

EXIT_WAIT_S = 15.0  # how long the running prompt gets to end after its pool call was stopped
POLL_S = 0.05
SETTLE_S = 0.5  # after the queue entry is done, ComfyUI's prompt loop logs and collects garbage once more


def comfy_prompt_running() -> bool:
    """Whether ComfyUI's queue has a prompt executing (False without ComfyUI)."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    return bool(getattr(getattr(instance, "prompt_queue", None), "currently_running", None))


def stop_running_prompt() -> None:
    from ...parallel.driver.pool import SHUTTING_DOWN, current_pool

    pool = current_pool()
    if pool is None or not pool.busy:
        return
    pool.stop_running_call(SHUTTING_DOWN)
    deadline = time.monotonic() + EXIT_WAIT_S
    while (pool.busy or comfy_prompt_running()) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    time.sleep(SETTLE_S)


_installed = []


def install() -> None:
    """Register the exit hook once."""
    if not _installed:
        atexit.register(stop_running_prompt)
        _installed.append(True)
