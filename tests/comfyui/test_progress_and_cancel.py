"""The sampler inside a real ComfyUI server: its progress bar over ``/ws``, and ComfyUI's interrupt.

Progress and interrupts cross two process boundaries here: the workers of the CPU pool report each denoise
step to the server, which turns it into ``progress`` websocket events; ``POST /interrupt`` must reach the
workers, end the prompt as interrupted, and leave the same pool ready for the next prompt. The sampler's
preview images ride on the same socket as binary messages, only while the pool node's ``previews`` is on.
"""

from __future__ import annotations

import io
from typing import Any, Callable

from comfyui_server import ComfyUIServer, EventListener, PromptResult, RejectedPrompt, ServerEvent
from PIL import Image
from test_comfyui_server import VIDEO_NODE, assert_video, saved_video
from workflow_graph import node_of_type, with_fresh_seed, with_inputs

PROMPT_TIMEOUT_S = 420.0
PROGRESS_STEPS = 6
# Several seconds of sampling on two CPU cores at 64x64, 5 frames (uninterrupted): an interrupt after the first
# step lands long before the last one.
LONG_RUN_STEPS = 400
# A deadline, not a measurement: the workers stop at the next step boundary, a few milliseconds away.
INTERRUPT_DEADLINE_S = 30.0
PREVIEW_IMAGE_EVENT = 1  # ComfyUI's BinaryEventTypes.PREVIEW_IMAGE: 4-byte format code, then a JPEG or PNG


def sampler_node_id(prompt: dict[str, Any]) -> str:
    return next(node_id for node_id, node in prompt.items() if node["class_type"] == "WanMeshSampler")


def submit_with_events(server: ComfyUIServer, prompt: dict[str, Any], listener: EventListener) -> str:
    prompt_id = server.submit(prompt, client_id=listener.client_id)
    assert not isinstance(prompt_id, RejectedPrompt), f"prompt rejected:\n{prompt_id.error_text()}"
    return prompt_id


def progress_of(events: list[ServerEvent], prompt_id: str, node_id: str) -> list[dict[str, Any]]:
    """The ``progress`` payloads of one node in one prompt, in arrival order."""
    return [event.data for event in events if event.kind == "progress"
            and event.data.get("prompt_id", prompt_id) == prompt_id and event.data.get("node") == node_id]


def is_interruption_of(prompt_id: str) -> Callable[[ServerEvent], bool]:
    return lambda event: event.kind == "execution_interrupted" and event.data.get("prompt_id") == prompt_id


def assert_succeeded(server: ComfyUIServer, result: PromptResult) -> None:
    assert result.status == "success", f"prompt failed:\n{result.error_text()}\n--- server log ---\n{server.log()}"


def run_with_events(server: ComfyUIServer, prompt: dict[str, Any]) -> tuple[str, list[ServerEvent]]:
    """Submit, wait for success and for the end-of-prompt event; the prompt id and every event received."""
    with server.listen() as listener:
        prompt_id = submit_with_events(server, prompt, listener)
        assert_succeeded(server, server.wait_for(prompt_id, PROMPT_TIMEOUT_S))
        # /history can be written before the last queued websocket events are delivered.
        listener.wait_for(lambda event: event.kind == "executing" and event.data.get("node") is None
                          and event.data.get("prompt_id", prompt_id) == prompt_id, 30.0, "the end-of-prompt event")
        return prompt_id, listener.events()


def preview_images(events: list[ServerEvent]) -> list[Image.Image]:
    """The preview images sent over ``/ws`` (binary messages), decoded."""
    return [Image.open(io.BytesIO(event.data["payload"][4:])) for event in events
            if event.kind == "binary" and event.data["event_type"] == PREVIEW_IMAGE_EVENT]


def test_previews_are_sent_only_when_the_pool_node_turns_them_on(comfyui_server: ComfyUIServer,
                                                                  t2v_prompt: dict[str, Any]) -> None:
    """previews on: an image per reported step; off: progress as before and not one preview image."""
    prompt = with_inputs(t2v_prompt, "WanMeshSampler", steps=PROGRESS_STEPS)
    sampler_id = sampler_node_id(prompt)
    assert node_of_type(prompt, "WanMeshPool")["inputs"]["previews"] is True, "the examples show previews"

    _, on_events = run_with_events(comfyui_server, prompt)
    off_prompt = with_fresh_seed(with_inputs(prompt, "WanMeshPool", previews=False))
    off_id, off_events = run_with_events(comfyui_server, off_prompt)

    shown = preview_images(on_events)
    assert len(shown) >= 2, f"previews on: {len(shown)} preview images for {PROGRESS_STEPS} steps"
    assert all(image.width > 0 and image.height > 0 for image in shown)
    assert progress_of(off_events, off_id, sampler_id), "previews off must still report progress"
    assert preview_images(off_events) == [], "previews off: the server still sent preview images"


def test_sampler_reports_every_step_up_to_max(comfyui_server: ComfyUIServer, t2v_prompt: dict[str, Any]) -> None:
    prompt = with_inputs(t2v_prompt, "WanMeshSampler", steps=PROGRESS_STEPS)
    sampler_id = sampler_node_id(prompt)

    with comfyui_server.listen() as listener:
        prompt_id = submit_with_events(comfyui_server, prompt, listener)
        assert_succeeded(comfyui_server, comfyui_server.wait_for(prompt_id, PROMPT_TIMEOUT_S))
        # /history can be written before the last queued websocket events are delivered.
        listener.wait_for(lambda event: event.kind == "executing" and event.data.get("node") is None
                          and event.data.get("prompt_id", prompt_id) == prompt_id, 30.0, "the end-of-prompt event")
        progress = progress_of(listener.events(), prompt_id, sampler_id)

    values = [message["value"] for message in progress]
    assert len(progress) >= 2, f"expected a progress event per step of node {sampler_id}, got {progress}"
    assert all(message["max"] == PROGRESS_STEPS for message in progress), progress
    # Newer ComfyUI versions throttle progress events, so steps may be missing, but never fractional or repeated.
    assert all(isinstance(value, int) for value in values), values
    assert values == sorted(set(values)) and values[0] >= 1, f"progress must rise step by step: {values}"
    assert values[-1] == PROGRESS_STEPS, f"progress ended at {values[-1]} of {PROGRESS_STEPS}: {values}"


def test_interrupt_stops_the_sampler_and_the_pool_serves_the_next_prompt(
        comfyui_server: ComfyUIServer, t2v_prompt: dict[str, Any]) -> None:
    long_prompt = with_inputs(t2v_prompt, "WanMeshSampler", steps=LONG_RUN_STEPS)
    sampler_id = sampler_node_id(long_prompt)

    with comfyui_server.listen() as listener:
        prompt_id = submit_with_events(comfyui_server, long_prompt, listener)
        listener.wait_for(lambda event: bool(progress_of([event], prompt_id, sampler_id)), PROMPT_TIMEOUT_S,
                          "progress event from the sampler")
        workers_before = {proc.pid for proc in comfyui_server.descendants()}
        comfyui_server.interrupt()
        interrupted = listener.wait_for(is_interruption_of(prompt_id), INTERRUPT_DEADLINE_S,
                                        "execution_interrupted event after POST /interrupt")
        result = comfyui_server.wait_for(prompt_id, INTERRUPT_DEADLINE_S)
        progress = progress_of(listener.events(), prompt_id, sampler_id)

    assert interrupted.data["node_id"] == sampler_id, f"interrupted elsewhere than the sampler: {interrupted.data}"
    assert result.status == "error", f"an interrupted prompt must not count as a success: {result.status}"
    assert [kind for kind, _ in result.messages if kind == "execution_error"] == [], result.error_text()
    save_node_ids = {node_id for node_id, node in long_prompt.items()
                     if node["class_type"] in ("SaveImage", VIDEO_NODE)}
    assert not save_node_ids & result.outputs.keys(), f"the interrupted prompt still saved frames: {result.outputs}"
    last_value = progress[-1]["value"]
    assert last_value < LONG_RUN_STEPS // 2, (
        f"the sampler went on to step {last_value} of {LONG_RUN_STEPS} after the interrupt")

    next_prompt = with_fresh_seed(t2v_prompt)
    after = comfyui_server.run(next_prompt, PROMPT_TIMEOUT_S)
    assert isinstance(after, PromptResult), f"prompt rejected:\n{after.error_text()}"
    assert_succeeded(comfyui_server, after)
    latent = node_of_type(next_prompt, "WanMeshEmptyLatent")["inputs"]
    assert_video(saved_video(comfyui_server, after, next_prompt), latent["length"] * latent["batch_size"],
                 latent["width"], latent["height"])
    workers_after = {proc.pid for proc in comfyui_server.descendants()}
    assert workers_before and workers_after == workers_before, (
        f"the interrupt replaced the worker pool: processes {sorted(workers_before)} became {sorted(workers_after)}")
