"""The stream_t2v example workflow in a real ComfyUI server: the WanMesh Stream Sampler writes each chunk into
the output folder while it runs and names it in a ``wanmesh.chunk`` websocket message (one per chunk, in order,
before the node finishes), each file reopens with the frame count the Wan VAE gives that chunk, the whole video
is saved, and ComfyUI's interrupt stops the run between steps keeping the chunks already written. Its WanMesh
Prompt Switch (a second prompt from chunk 2 on) gives the command line's latents with ``--prompt-at 2:PROMPT`` (on
one rank: the workflow's two Ulysses ranks equal it), and the chunks before it are those of the workflow without
the switch; a re-anchored rolling window (kv_window, sink, reanchor) gives the command line's latents too. On
ComfyUI 0.33, prompts posted to ``/wanmesh/stream/<prompt id>/prompt`` (one while the prompt is
queued, one once the first is answered, while the stream runs) switch the stream at the chunks the answers name,
as WanMesh Prompt Switch nodes at those chunks do; a stream without a text encoder, an unknown id and a body
without a prompt are answered 409, 404 and 400 in one line."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from comfyui_server import ComfyUIServer, PromptResult, RejectedPrompt
from workflow_graph import MAX_SEED, load_workflow, node_of_type, with_inputs

from safetensors.torch import load_file
from test_native_sampling import largest_difference, save_latent, saved

from wanmesh.parallel import read_video
from wanmesh.parallel.cli import main

PROMPT_TIMEOUT_S = 420.0
SAMPLER = "WanMeshStreamSampler"


@pytest.fixture()
def stream_prompt() -> dict[str, Any]:
    return with_inputs(load_workflow("api/stream_t2v.json"), SAMPLER, seed=random.randint(0, MAX_SEED))


def _node_id(prompt: dict[str, Any], class_type: str) -> str:
    return next(node_id for node_id, node in prompt.items() if node["class_type"] == class_type)


def _expected_chunk_frames(prompt: dict[str, Any]) -> list[int]:
    """Image frames per chunk, worked out here: latent frames (length-1)/4+1 cut into chunks, the first latent
    frame decoding to 1 image frame and every later one to 4."""
    latent_frames = (node_of_type(prompt, "WanMeshEmptyLatent")["inputs"]["length"] - 1) // 4 + 1
    chunk = node_of_type(prompt, SAMPLER)["inputs"]["chunk"]
    sizes = [min(chunk, latent_frames - start) for start in range(0, latent_frames, chunk)]
    return [4 * n - 3 if i == 0 else 4 * n for i, n in enumerate(sizes)]


def _file(server: ComfyUIServer, info: dict[str, Any]):
    return server.output_dir / info["subfolder"] / info["filename"]


def _command_line_latents(prompt: dict[str, Any], models_dir, tmp_path, *extra: str) -> torch.Tensor:
    """The latents `wanmesh stream` saves on one rank for the workflow's texts, prompt switch, size and sampler
    inputs, with ``extra`` flags."""
    sampler_id = _node_id(prompt, SAMPLER)
    inputs, size = prompt[sampler_id]["inputs"], prompt[_node_id(prompt, "WanMeshEmptyLatent")]["inputs"]
    switch = prompt[inputs["prompt_switches"][0]]["inputs"]
    text = lambda node: prompt[node["positive"][0]]["inputs"]["text"]  # noqa: E731
    saved_latents = tmp_path / "latents.safetensors"
    assert main(["stream", "--models", str(models_dir), "--prompt", text(inputs), "--prompt-at",
                 f"{switch['chunk']}:{text(switch)}", "--width", str(size["width"]), "--height", str(size["height"]),
                 "--frames", str(size["length"]), "--chunk", str(inputs["chunk"]), "--steps", str(inputs["steps"]),
                 "--shift", str(inputs["shift"]), "--seed", str(inputs["seed"]), *extra, "--device", "cpu", "--quiet",
                 "--out", str(tmp_path / "v.mp4"), "--chunk-dir", str(tmp_path / "chunks"),
                 "--save-latents", str(saved_latents)]) == 0
    return load_file(str(saved_latents))["latents"]


def test_stream_workflow_announces_each_chunk_file_then_saves_the_video(comfyui_server: ComfyUIServer,
                                                                         stream_prompt: dict[str, Any]) -> None:
    sampler_id = _node_id(stream_prompt, SAMPLER)
    with comfyui_server.listen() as listener:
        prompt_id = comfyui_server.submit(stream_prompt, client_id=listener.client_id)
        assert not isinstance(prompt_id, RejectedPrompt), prompt_id.error_text()
        result = comfyui_server.wait_for(prompt_id, PROMPT_TIMEOUT_S)
        assert result.status == "success", f"{result.error_text()}\n--- server log ---\n{comfyui_server.log()}"
        listener.wait_for(lambda e: e.kind == "executing" and e.data.get("node") is None
                          and e.data.get("prompt_id", prompt_id) == prompt_id, 30.0, "the end-of-prompt event")
        events = listener.events()

    chunk_events = [(i, e.data) for i, e in enumerate(events) if e.kind == "wanmesh.chunk"
                    and e.data["prompt_id"] == prompt_id]
    executed_at = next(i for i, e in enumerate(events) if e.kind == "executed" and e.data.get("node") == sampler_id)
    expected = _expected_chunk_frames(stream_prompt)
    assert [data["chunk"] for _, data in chunk_events] == list(range(len(expected)))
    assert all(index < executed_at for index, _ in chunk_events), "chunks must be announced while the node runs"
    assert all(data["node"] == sampler_id and data["type"] == "output" for _, data in chunk_events)
    chunk_videos = [read_video(_file(comfyui_server, data)) for _, data in chunk_events]
    assert [v.shape[0] for v in chunk_videos] == [data["frames"] for _, data in chunk_events] == expected
    assert [data["first_frame"] for _, data in chunk_events] == [sum(expected[:i]) for i in range(len(expected))]

    sampler_output = result.outputs[sampler_id]
    whole = {"filename": sampler_output["video_file"][0], "subfolder": sampler_output["subfolder"][0]}
    saved = result.outputs[_node_id(stream_prompt, "WanMeshSaveVideo")]["images"][0]
    for info in (whole, saved):
        video = read_video(_file(comfyui_server, info))
        assert video.shape[0] == sum(expected)
        assert (torch.cat(chunk_videos) - video).abs().mean() < 0.03  # lossy H.264 of the same frames
    assert result.outputs[sampler_id]["chunk_files"] == [d["filename"] for _, d in chunk_events]
    assert all(d["subfolder"] == whole["subfolder"] for _, d in chunk_events)


def test_interrupt_keeps_the_chunks_already_written(comfyui_server: ComfyUIServer,
                                                    stream_prompt: dict[str, Any]) -> None:
    long_prompt = with_inputs(stream_prompt, SAMPLER, steps=300)  # chunk 0 in well under a minute, the rest far off
    with comfyui_server.listen() as listener:
        prompt_id = comfyui_server.submit(long_prompt, client_id=listener.client_id)
        assert not isinstance(prompt_id, RejectedPrompt), prompt_id.error_text()
        first = listener.wait_for(lambda e: e.kind == "wanmesh.chunk" and e.data["prompt_id"] == prompt_id,
                                  PROMPT_TIMEOUT_S, "the first chunk")
        comfyui_server.interrupt()
        result = comfyui_server.wait_for(prompt_id, 60.0)
        chunks = [e.data for e in listener.events() if e.kind == "wanmesh.chunk" and e.data["prompt_id"] == prompt_id]
    assert isinstance(result, PromptResult) and result.status == "error"
    assert 1 <= len(chunks) < len(_expected_chunk_frames(long_prompt)), chunks
    assert read_video(_file(comfyui_server, first.data)).shape[0] == first.data["frames"]
    assert [k for k, _ in result.messages if k == "execution_interrupted"], result.messages


def test_the_prompt_switch_is_the_command_lines_and_keeps_the_chunks_before_it(
        comfyui_server: ComfyUIServer, stream_prompt: dict[str, Any], tiny_models_dir, tmp_path) -> None:
    sampler_id = _node_id(stream_prompt, SAMPLER)
    switch = stream_prompt[stream_prompt[sampler_id]["inputs"]["prompt_switches"][0]]
    plain = {**stream_prompt, sampler_id: {**stream_prompt[sampler_id], "inputs": {
        key: value for key, value in stream_prompt[sampler_id]["inputs"].items() if key != "prompt_switches"}}}
    latents = {}
    for name, prompt in (("switched", stream_prompt), ("plain", plain)):
        prompt = {**prompt, "latent_out": save_latent(sampler_id, f"stream_{name}")}
        result = comfyui_server.run(prompt, PROMPT_TIMEOUT_S)
        assert result.status == "success", result.error_text()
        latents[name] = saved(comfyui_server, result, "latent_out")
    assert largest_difference(latents["switched"], _command_line_latents(stream_prompt, tiny_models_dir, tmp_path)) < 1e-4
    before = switch["inputs"]["chunk"] * stream_prompt[sampler_id]["inputs"]["chunk"]  # latent frames before it
    assert largest_difference(latents["switched"][:, :, :before], latents["plain"][:, :, :before]) < 1e-4
    assert largest_difference(latents["switched"][:, :, before:], latents["plain"][:, :, before:]) > 1e-2


def test_a_reanchored_window_is_the_command_lines(comfyui_server: ComfyUIServer, stream_prompt: dict[str, Any],
                                                 tiny_models_dir, tmp_path) -> None:
    """kv_window 3, sink 1 and reanchor on the sampler (its prompt switch left in): the latents equal the command
    line's with ``--kv-window 3 --sink 1 --reanchor`` and the same switch on one rank, and differ from the same
    window without re-anchoring after it rolls."""
    sampler_id = _node_id(stream_prompt, SAMPLER)
    latents = {}
    for reanchor in (True, False):
        prompt = with_inputs(stream_prompt, SAMPLER, kv_window=3, sink=1, reanchor=reanchor)
        prompt = {**prompt, "latent_out": save_latent(sampler_id, f"stream_reanchor_{reanchor}")}
        result = comfyui_server.run(prompt, PROMPT_TIMEOUT_S)
        assert result.status == "success", result.error_text()
        latents[reanchor] = saved(comfyui_server, result, "latent_out")
    expected = _command_line_latents(stream_prompt, tiny_models_dir, tmp_path, "--kv-window", "3", "--sink", "1",
                                     "--reanchor")
    assert largest_difference(latents[True], expected) < 1e-4
    assert largest_difference(latents[True], latents[False]) > 1e-2


LIVE_TEXTS = ("the fox leaps over a frozen stream", "the fox curls up asleep in a den")
LIVE_LENGTH = 33  # 9 latent frames: chunks of 2 give 5 chunks, so the second post has chunks left to land on


def _without_switches(prompt: dict[str, Any], live: bool) -> dict[str, Any]:
    """The stream workflow with its WanMesh Prompt Switch (and its text) left out, LIVE_LENGTH frames long; its
    text encoder connected to the sampler's ``text_encoder`` when ``live`` (else not: no posted prompts)."""
    sampler_id = _node_id(prompt, SAMPLER)
    switch_id = prompt[sampler_id]["inputs"]["prompt_switches"][0]
    dropped = {switch_id, prompt[switch_id]["inputs"]["positive"][0]}
    inputs = {key: value for key, value in prompt[sampler_id]["inputs"].items()
              if key not in ("prompt_switches", "text_encoder")}
    sampler_inputs = {"text_encoder": [_node_id(prompt, "WanMeshTextEncoderLoader"), 0]} if live else {}
    prompt = {node_id: node for node_id, node in prompt.items() if node_id not in dropped}
    prompt[sampler_id] = {**prompt[sampler_id], "inputs": {**inputs, **sampler_inputs}}
    latent_id = _node_id(prompt, "WanMeshEmptyLatent")
    prompt[latent_id] = {**prompt[latent_id], "inputs": {**prompt[latent_id]["inputs"], "length": LIVE_LENGTH}}
    return {**prompt, "latent_out": save_latent(sampler_id, "stream_live")}


def _with_scheduled_switches(prompt: dict[str, Any], switches: dict[str, int]) -> dict[str, Any]:
    """``prompt`` with chained WanMesh Prompt Switch nodes: each text (WanMesh Text Encode) from its chunk on."""
    prompt, encoder_id = dict(prompt), _node_id(prompt, "WanMeshTextEncoderLoader")
    previous = None
    for number, (text, chunk) in enumerate(switches.items()):
        prompt[f"text_{number}"] = {"class_type": "WanMeshTextEncode", "inputs": {"text_encoder": [encoder_id, 0],
                                                                                   "text": text}}
        inputs = {"positive": [f"text_{number}", 0], "chunk": chunk}
        if previous is not None:
            inputs["switches"] = [previous, 0]
        prompt[f"switch_{number}"] = {"class_type": "WanMeshPromptSwitch", "inputs": inputs}
        previous = f"switch_{number}"
    sampler_id = _node_id(prompt, SAMPLER)
    prompt[sampler_id] = {**prompt[sampler_id], "inputs": {**prompt[sampler_id]["inputs"],
                                                          "prompt_switches": [previous, 0]}}
    return prompt


def _post_prompt(server: ComfyUIServer, stream_id: str, body: Any) -> tuple[int, Any]:
    return server.post_json(f"/wanmesh/stream/{stream_id}/prompt", body, timeout_s=PROMPT_TIMEOUT_S)


def test_prompts_posted_to_a_running_stream_switch_it_as_prompt_switch_nodes_do(
        recent_comfyui_server: ComfyUIServer, stream_prompt: dict[str, Any]) -> None:
    server = recent_comfyui_server
    live = _without_switches(stream_prompt, live=True)
    prompt_id = server.submit(live)
    assert not isinstance(prompt_id, RejectedPrompt), prompt_id.error_text()
    answers = [_post_prompt(server, prompt_id, {"prompt": text}) for text in LIVE_TEXTS]  # the 2nd once the 1st applied
    result = server.wait_for(prompt_id, PROMPT_TIMEOUT_S)
    assert result.status == "success", f"{result.error_text()}\n--- server log ---\n{server.log()}"
    assert [status for status, _ in answers] == [200, 200], answers
    chunks = {answer["prompt"]: answer["chunk"] for _, answer in answers}
    assert chunks[LIVE_TEXTS[0]] == 1 and chunks[LIVE_TEXTS[1]] > 1, answers  # the queued post: the first chunk it can

    scheduled = _with_scheduled_switches(_without_switches(stream_prompt, live=False), chunks)
    scheduled_id = server.submit(scheduled)
    assert not isinstance(scheduled_id, RejectedPrompt), scheduled_id.error_text()
    status, refused = _post_prompt(server, scheduled_id, {"prompt": LIVE_TEXTS[0]})  # this one has no text encoder
    scheduled_result = server.wait_for(scheduled_id, PROMPT_TIMEOUT_S)
    assert scheduled_result.status == "success", scheduled_result.error_text()
    assert largest_difference(saved(server, result, "latent_out"), saved(server, scheduled_result, "latent_out")) < 1e-4
    assert status == 409 and "text_encoder" in refused["error"], refused

    assert _post_prompt(server, "no-such-prompt", {"prompt": "a cat"})[0] == 404
    status, bad = _post_prompt(server, prompt_id, {"text": "a cat"})
    assert status == 400 and '"prompt"' in bad["error"], bad
