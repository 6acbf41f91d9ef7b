"""One rank's part of a streaming (causal, chunk by chunk) request; runs in a worker process.

Every rank runs the causal sampling loop (``sampling/stream.py``) together; rank 0 decodes each finished chunk
with the streaming VAE (``models/vae_stream.py``) and sends it to the driver at once, as a progress message
carrying the chunk's index, start frame, raw latents and decoded frames (the local backend moves the arrays
through a shared-memory segment the driver takes over, ``worker/main.py``). The reply holds the whole latent and
the joined frames, which equal one whole VAE decode.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..networks.frames import pixels_to_frames
from ..networks.vae_stream import StreamingVaeDecoder
from ..networks.wan_inputs import compute_dtype
from ..protocol import LIVE_PROMPT_EVENT, StreamSample
from ..sampling.loop import text_context


class ChunkForwarder:
    """``on_chunk`` for the sampling loop on rank 0: decode the chunk, keep its pixels, send it to the driver."""

    def __init__(self, decoder: StreamingVaeDecoder | None, progress, send_previews: bool):
        self.decoder = decoder
        self.progress = progress
        self.send_previews = send_previews
        self.pixels: list[torch.Tensor] = []

    def __call__(self, index: int, start_frame: int, latents: torch.Tensor) -> None:
        latents = latents.float().cpu()
        frames = None
        if self.decoder is not None:
            pixels = self.decoder.decode_pixels(latents)
            self.pixels.append(pixels.float().cpu())
            frames = pixels_to_frames(pixels)
        send = getattr(self.progress, "send_chunk", None)
        if self.send_previews and send is not None:
            send({"index": int(index), "start_frame": int(start_frame), "latents": latents, "frames": frames})

    def joined_frames(self) -> torch.Tensor | None:
        """Every chunk's frames in order, [B*F, H, W, 3] (batch rows one after another, as a whole decode gives)."""
        return pixels_to_frames(torch.cat(self.pixels, dim=2)) if self.pixels else None


def run_stream(model, vae, request: StreamSample, *, device, rank: int, plan=None, progress=None,
               should_stop: Callable[[], bool] | None = None, live_prompt: Callable | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """(raw latents [B, 16, T, h, w], frames or None, the step cache's report or {}) for a validated request;
    every rank calls it together (and, with a step cache, checks that all took the same decisions).
    ``live_prompt()``: (text, its embeddings) of a prompt posted while the stream runs, or None; the same on every
    rank. Rank 0 reports the chunk where each applies as a ``protocol.LIVE_PROMPT_EVENT`` event."""
    from ..cache_settings import cache_settings
    from ..sampling.stream import sample_stream, stream_sigmas  # the causal model code loads with the request

    dtype = compute_dtype(model)
    batch = request.latent.shape[0]
    positive = text_context(request.positive, batch, dtype, device)
    negative = text_context(request.negative, batch, dtype, device) if request.guidance_scale != 1.0 else None
    switches = {int(index): text_context(embeddings, batch, dtype, device)
                for index, embeddings in zip(request.switch_chunks, request.switch_positive)}
    forwarder, stats = None, {}
    if rank == 0:
        decoder = StreamingVaeDecoder(vae, device) if vae is not None else None
        forwarder = ChunkForwarder(decoder, progress, request.preview)
    def live_switch(index: int) -> torch.Tensor | None:
        posted = live_prompt()
        if posted is None:
            return None
        text, embeddings = posted
        send = getattr(progress, "send_event", None)
        if rank == 0 and send is not None:
            send({LIVE_PROMPT_EVENT: {"chunk": int(index), "prompt": text}})
        return text_context(embeddings, batch, dtype, device)

    latents = sample_stream(
        model, positive=positive, negative=negative, latent_shape=tuple(request.latent.shape), seed=request.seed,
        sigmas=stream_sigmas(request.steps, request.shift, request.timesteps), chunk=request.chunk,
        kv_window=request.kv_window, sink=request.sink, reanchor=request.reanchor, use_cache=request.use_cache,
        guidance_scale=request.guidance_scale, plan=plan, on_chunk=forwarder, should_stop=should_stop,
        progress=progress, start_latent=request.start_latent, step_cache=cache_settings(request.cache), stats=stats,
        prompt_switches=switches, live_switch=None if live_prompt is None else live_switch,
    )
    if "cache_report" in stats:
        from ..sampling.step_cache import check_same_decisions

        check_same_decisions(stats["cache_decisions"], max(stats["cache_decisions"], default=-1) + 1, device)
    frames = forwarder.joined_frames() if forwarder is not None else None
    return latents.float().cpu(), frames, stats.get("cache_report", {})
