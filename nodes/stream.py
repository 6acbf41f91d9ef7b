"""Streaming (causal Wan) sampler node: chunk by chunk, each finished chunk shown, saved and announced at once;
optionally from a start image (as ComfyUI's ARVideoI2V: its latent frame first, written to the KV cache), and
with prompt switches (WanMesh Prompt Switch nodes, chained: the prompt changes before the chunk each names, the
cached frames re-encoded under the new prompt).

While it runs, every chunk the workers finish is decoded there by the streaming VAE, shown as the progress
preview, written to ComfyUI's output folder as ``<prefix>_<counter>_chunk_NNN.mp4`` (atomically, by
``parallel/video_io.py``) and named in a ``wanmesh.chunk`` websocket message, so API clients can fetch chunks as
they arrive; then the whole video is written like WanMesh Save Video does. Cancel stops between steps and keeps
the chunks already written. A chunk file the output folder cannot take (deleted meanwhile) is logged and kept,
and written once the folder is back (at the latest with the whole video); the node fails naming any still lost.
"""

from __future__ import annotations

import logging
import os

import torch

from ..parallel import Cancelled, H264_ENCODERS, StreamSample, parse_stream_timesteps, video_encoder, write_video
from ..parallel.cache_settings import describe_report
from ..parallel.fields import node_input
from ..parallel.config import check_stream_start
from ..parallel.image_to_video import stream_start_frame
from .bridge import live_streams
from .bridge.convert import image_to_frames, latent_to_tensor, read_conditioning, tensor_to_latent
from .bridge.runtime import PREVIEW_MAX_RESOLUTION, arrange_for_job, interrupted, previews_enabled, raise_if_interrupted

CHUNK_EVENT = "wanmesh.chunk"
log = logging.getLogger("wanmesh")


class ChunkSaver:
    """``on_chunk`` of the node: preview, chunk file, websocket message; names files like SaveImage does."""

    def __init__(self, filename_prefix: str, width: int, height: int, fps: float, bar, node_id):
        import folder_paths  # ComfyUI's module: only there when ComfyUI runs this node

        from ..parallel.driver.stream_chunks import ChunkFolder

        self.folder, self.name, self.counter, self.subfolder, _ = folder_paths.get_save_image_path(
            filename_prefix, folder_paths.get_output_directory(), width, height)
        self.fps, self.bar, self.node_id = fps, bar, node_id
        self.files: list[str] = []
        self.chunk_files = ChunkFolder(self.folder, lambda frames, path: write_video(frames, path, self.fps),
                                       lambda warning: log.warning("WanMesh Stream Sampler: %s", warning))

    def file_info(self, filename: str) -> dict:
        codec = "h264" if video_encoder() in H264_ENCODERS else "mpeg4"
        return {"filename": filename, "subfolder": self.subfolder, "type": "output", "format": f"video/{codec}-mp4"}

    def __call__(self, chunk) -> None:
        if chunk.frames is None:
            return  # no VAE: nothing to show or save for this chunk
        filename = f"{self.name}_{self.counter:05}_chunk_{chunk.index:03}.mp4"
        written = self.chunk_files.add(filename, chunk.frames).is_file()  # else kept and reported (ChunkFolder)
        self.files.append(filename)
        self._show(chunk.frames[-1])
        if written:
            self._announce(chunk, filename)

    def _show(self, frame: torch.Tensor) -> None:
        from PIL import Image

        pixels = (frame.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
        self.bar.update_absolute(self.bar.current, self.bar.total, ("JPEG", Image.fromarray(pixels), PREVIEW_MAX_RESOLUTION))

    def _announce(self, chunk, filename: str) -> None:
        from server import PromptServer  # ComfyUI's server module

        server = PromptServer.instance
        message = {**self.file_info(filename), "chunk": chunk.index, "start_latent_frame": chunk.start_frame,
                   "first_frame": chunk.first_image_frame, "frames": int(chunk.frames.shape[0]),
                   "prompt_id": _running_prompt_id(), "node": self.node_id}
        server.send_sync(CHUNK_EVENT, message, getattr(server, "client_id", None))

    def save_whole(self, frames: torch.Tensor) -> dict:
        filename = f"{self.name}_{self.counter:05}_.mp4"
        write_video(frames, os.path.join(self.folder, filename), self.fps)
        self.chunk_files.finish(os.path.join(self.folder, filename))  # the chunks the folder lost: written, or an error
        return self.file_info(filename)


def _running_prompt_id() -> str | None:
    """The id of the ComfyUI prompt being executed (its server keeps it as ``last_prompt_id``)."""
    from server import PromptServer  # ComfyUI's server module

    return getattr(PromptServer.instance, "last_prompt_id", None)


def _live_text_encoder(text_encoder, model) -> str | None:
    """The handle that encodes posted prompts (None without a text_encoder); it must live in the model's pool."""
    if text_encoder is None:
        return None
    if text_encoder.runner.pool is not model.runner.pool:
        raise ValueError("text_encoder and model are loaded in different worker pools; connect both loaders to the "
                         "same WanMesh Pool")
    return text_encoder.handle


PROMPT_SWITCHES = "WANMESH_PROMPT_SWITCHES"  # ((chunk, embeddings), ...) in chunk order


class WanMeshPromptSwitch:
    """One prompt switch of a stream: from chunk ``chunk`` on, the stream follows ``positive``; chained after
    ``switches`` (earlier switches) to switch several times."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "positive": ("CONDITIONING", {"tooltip": "the prompt from this chunk on"}),
                "chunk": node_input("switch_chunk"),
            },
            "optional": {"switches": (PROMPT_SWITCHES, {"tooltip": "earlier switches, to switch several times"})},
        }

    RETURN_TYPES = (PROMPT_SWITCHES,)
    RETURN_NAMES = ("switches",)
    OUTPUT_TOOLTIPS = ("the switches so far, for the WanMesh Stream Sampler or the next WanMesh Prompt Switch",)
    FUNCTION = "switch"
    CATEGORY = "WanMesh/sampling"
    DESCRIPTION = ("A prompt switch for the WanMesh Stream Sampler: the stream moves on to this prompt at the given "
                   "chunk without a cut (the frames it keeps in its cache are re-encoded under the new prompt).")

    def switch(self, positive, chunk, switches=()):
        if any(index == chunk for index, _ in switches):
            raise ValueError(f"two WanMesh Prompt Switch nodes name chunk {chunk}; give each switch its own chunk")
        added = (int(chunk), read_conditioning(positive, "positive").embeddings)
        return (tuple(sorted((*switches, added), key=lambda item: item[0])),)


class WanMeshStreamSampler:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("WANMESH_MODEL", {"tooltip": "the loaded causal Wan 2.1 transformer (Self-Forcing, CausVid, "
                                                       "...); Wan 2.1 T2V weights also run causally"}),
                "positive": ("CONDITIONING", {"tooltip": "prompt"}),
                "latent": ("LATENT", {"tooltip": "empty latent (WanMesh Empty Latent) fixing size and length"}),
                "seed": node_input("seed"),
                "steps": node_input("stream_steps"),
                "shift": node_input("stream_shift"),
                "cfg": node_input("stream_cfg"),
                "chunk": node_input("chunk"),
                "kv_window": node_input("kv_window"),
                "sink": node_input("sink"),
                "filename_prefix": ("STRING", {"default": "WanMesh/stream",
                                               "tooltip": "file name start of the chunk files and the whole video"}),
                "fps": node_input("fps"),
            },
            "optional": {
                "negative": ("CONDITIONING", {"tooltip": "negative prompt, used only when cfg is not 1"}),
                "vae": ("WANMESH_VAE", {"tooltip": "decodes each chunk as it finishes (needed for previews, chunk "
                                                   "files and the IMAGE output)"}),
                "timesteps": node_input("timesteps"),
                "start_image": ("IMAGE", {"tooltip": "start the stream from this image (as ComfyUI's ARVideoI2V): "
                                                     "the first image, resized and center-cropped to the latent's "
                                                     "size, encoded by the vae to the first latent frame"}),
                "cache": ("WANMESH_CACHE", {"tooltip": "step caching (WanMesh Cache) within each chunk: its steps "
                                                       "count from the chunk's first; none: every step computed"}),
                "prompt_switches": (PROMPT_SWITCHES, {"tooltip": "WanMesh Prompt Switch nodes: the prompt changes "
                                                                 "before the chunks they name"}),
                "text_encoder": ("WANMESH_TEXT_ENCODER", {"tooltip": "takes prompts posted while the stream runs "
                                                                     "(POST /wanmesh/stream/<prompt id>/prompt), "
                                                                     "encoded by this text encoder on the pool"}),
                "reanchor": node_input("reanchor"),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    RETURN_TYPES = ("LATENT", "IMAGE")
    RETURN_NAMES = ("latent", "images")
    OUTPUT_TOOLTIPS = ("the whole video's raw latents", "the decoded frames (empty [0, H, W, 3] without a vae)")
    FUNCTION = "sample"
    OUTPUT_NODE = True
    CATEGORY = "WanMesh/sampling"
    DESCRIPTION = ("Causal streaming sampler: makes the video chunk by chunk with a KV cache on the worker pool "
                   "(sequence and tensor parallel), from the prompt alone or from a start image (as ARVideoI2V). "
                   "With a VAE every finished chunk is shown, saved to the output folder and announced on the "
                   "websocket ('wanmesh.chunk') while the rest is being made.")

    def sample(self, model, positive, latent, seed, steps, shift, cfg, chunk, kv_window, sink, filename_prefix, fps,
               negative=None, vae=None, timesteps="", start_image=None, cache=None, prompt_switches=(), text_encoder=None,
               reanchor=False, unique_id=None):
        import comfy.utils

        samples = latent_to_tensor(latent)
        start_latent = self._start_latent(start_image, vae, samples, kv_window or None, sink)
        request = StreamSample(
            handle=model.handle, latent=samples, positive=read_conditioning(positive, "positive").embeddings,
            negative=[] if negative is None else read_conditioning(negative, "negative").embeddings, seed=seed,
            steps=steps, shift=shift, timesteps=parse_stream_timesteps(timesteps), guidance_scale=cfg, chunk=chunk,
            kv_window=kv_window or None, sink=sink, reanchor=reanchor, vae_handle=None if vae is None else vae.handle,
            preview=previews_enabled(model.runner), start_latent=start_latent, cache=cache,
            switch_chunks=[index for index, _ in prompt_switches],
            switch_positive=[embeddings for _, embeddings in prompt_switches],
            live_text_encoder=_live_text_encoder(text_encoder, model))
        request.validate()  # before any file name is taken
        arrange_for_job(model, samples, steps, cfg, streaming=True)
        bar = comfy.utils.ProgressBar(1)
        saver = ChunkSaver(filename_prefix, samples.shape[-1] * 8, samples.shape[-2] * 8, fps, bar, unique_id)
        stream_id = str(_running_prompt_id())
        live = live_streams.open_stream(stream_id, takes_prompts=text_encoder is not None)
        ended = f"the stream of prompt {stream_id} failed or was stopped before a later chunk"
        try:
            result = model.runner.stream(request, on_chunk=saver, progress=bar.update_absolute, should_stop=interrupted,
                                         live=live)
            ended = f"the stream of prompt {stream_id} ended before a later chunk"
        except Cancelled:
            raise_if_interrupted()
            raise
        finally:
            live_streams.close_stream(stream_id, ended)
        if result.cache_report:
            log.info("WanMesh Stream Sampler: %s", describe_report(result.cache_report))
        return self._outputs(result, saver, samples)

    @staticmethod
    def _start_latent(start_image, vae, samples: torch.Tensor, kv_window: int | None, sink: int) -> torch.Tensor | None:
        """The start image's first latent frame, encoded by the vae on the pool (None without a start image)."""
        if start_image is None:
            return None
        if vae is None:
            raise ValueError("start_image needs the vae input, which encodes it: connect a WanMesh VAE Loader")
        check_stream_start(1, samples.shape[2], kv_window, sink)  # before the encode: one image, one latent frame
        frame = stream_start_frame(image_to_frames(start_image), samples.shape[-1] * 8, samples.shape[-2] * 8)
        return vae.runner.encode(vae.handle, frame)

    @staticmethod
    def _outputs(result, saver: ChunkSaver, samples: torch.Tensor) -> dict:
        latent = tensor_to_latent(result.latents)
        if result.frames is None:
            empty = torch.zeros(0, samples.shape[-2] * 8, samples.shape[-1] * 8, 3)
            return {"ui": {}, "result": (latent, empty)}
        video = saver.save_whole(result.frames)
        # File names as plain strings (one subfolder for all): the node itself shows the live chunk previews, and
        # a video result here would make the recent frontend load those previews as media; Save Video plays it.
        ui = {"video_file": [video["filename"]], "subfolder": [video["subfolder"]], "chunk_files": list(saver.files)}
        return {"ui": ui, "result": (latent, result.frames)}
