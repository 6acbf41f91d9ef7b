"""Prompts posted to a running WanMesh stream over HTTP; runs in the ComfyUI process.

``POST /wanmesh/stream/<prompt id>/prompt`` with ``{"prompt": "..."}`` switches the stream of that ComfyUI prompt
(a WanMesh Stream Sampler with a ``text_encoder`` connected) to the new text at the next chunk boundary, as a
WanMesh Prompt Switch at that chunk would: the answer, once the switch is made, is ``{"stream": id, "chunk": N,
"prompt": text}``. A prompt may be posted while its ComfyUI prompt is still queued (it then applies at chunk 1);
several posts apply in order, one per chunk. Errors answer in one line: 400 for a body without a prompt text,
404 for an id that is neither queued nor streaming, 409 when the stream takes no posted prompts or ended first.

The registry maps a ComfyUI prompt id to its ``LivePrompts`` (``parallel/driver/live_prompts.py``); the stream
node opens it when it starts and closes it when it ends.
"""

from __future__ import annotations

import asyncio
import sys
import threading

from ...parallel.driver.live_prompts import LivePrompts, StreamEnded

ROUTE = "/wanmesh/stream/{stream_id}/prompt"
WAIT_POLL_S = 1.0  # how often a waiting post checks that its ComfyUI prompt is still queued or running
NO_LIVE_INPUT = ("takes no posted prompts: connect a WanMesh Text Encoder Loader (on the stream's pool) to the "
                 "WanMesh Stream Sampler's text_encoder input")

_lock = threading.Lock()
_streams: dict[str, LivePrompts] = {}  # by ComfyUI prompt id: streams running, or posted to while queued
_running: set[str] = set()  # the ids whose stream node runs now
_refusing: dict[str, str] = {}  # prompt ids whose running stream takes no posted prompts, and why


def open_stream(stream_id: str, takes_prompts: bool) -> LivePrompts | None:
    """The stream node of ``stream_id`` starts: its posted prompts (those posted while it was queued included),
    or None when it takes none (posts already waiting are answered with the reason)."""
    with _lock:
        _running.add(stream_id)
        live = _streams.setdefault(stream_id, LivePrompts())
        if not takes_prompts:
            _refusing[stream_id] = f"the stream of prompt {stream_id} {NO_LIVE_INPUT}"
    if not takes_prompts:
        live.close(_refusing[stream_id])
        return None
    return live


def close_stream(stream_id: str, why: str) -> None:
    """The stream node of ``stream_id`` ended (``why``): prompts it did not apply are answered with the reason."""
    with _lock:
        _running.discard(stream_id)
        _refusing.pop(stream_id, None)
        live = _streams.pop(stream_id, None)
    if live is not None:
        live.close(why)


def _queued_or_running(stream_id: str) -> bool:
    """Whether ComfyUI's queue holds the prompt ``stream_id`` (pending or executing)."""
    instance = getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)
    queue = getattr(instance, "prompt_queue", None)
    if queue is None:
        return False
    running, pending = queue.get_current_queue()
    return any(len(item) > 1 and item[1] == stream_id for item in (*running, *pending))


def _stream_for_post(stream_id: str) -> LivePrompts | None:
    with _lock:
        if stream_id in _refusing:
            raise StreamEnded(_refusing[stream_id])
        if stream_id in _streams:
            return _streams[stream_id]
    if not _queued_or_running(stream_id):
        return None
    with _lock:
        return _streams.setdefault(stream_id, LivePrompts())


def _abandon_if_gone(stream_id: str, live: LivePrompts) -> None:
    """A post made while its prompt was queued: when the prompt left the queue without its stream starting."""
    with _lock:
        started = stream_id in _running or _streams.get(stream_id) is not live
    if not started and not _queued_or_running(stream_id):
        with _lock:
            if _streams.get(stream_id) is live:
                del _streams[stream_id]
        live.close(f"prompt {stream_id} ended without a WanMesh Stream Sampler running")


async def post_prompt(request):
    from aiohttp import web

    stream_id = request.match_info["stream_id"]
    try:
        body = await request.json()
    except ValueError:
        body = None
    text = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(text, str) or not text.strip():
        return web.json_response({"error": 'the body must be JSON {"prompt": "<new prompt text>"}'}, status=400)
    try:
        live = _stream_for_post(stream_id)
        if live is None:
            return web.json_response({"error": f"no prompt {stream_id} is queued or streaming; post to the id that "
                                               "/prompt answered for a workflow with a WanMesh Stream Sampler"},
                                     status=404)
        future = asyncio.wrap_future(live.post(text))
        while True:
            try:
                chunk = await asyncio.wait_for(asyncio.shield(future), WAIT_POLL_S)
                break
            except asyncio.TimeoutError:
                _abandon_if_gone(stream_id, live)
    except StreamEnded as ended:
        return web.json_response({"error": str(ended)}, status=409)
    return web.json_response({"stream": stream_id, "chunk": chunk, "prompt": text})


def install() -> None:
    """Add the route to ComfyUI's server (nothing outside ComfyUI)."""
    instance = getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)
    routes = getattr(instance, "routes", None)
    if routes is not None:
        routes.post(ROUTE)(post_prompt)
