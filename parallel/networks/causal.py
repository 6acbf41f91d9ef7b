"""Causal (block-by-block) Wan applied from outside diffusers' Wan transformer; runs in the workers.

Causal checkpoints (Self-Forcing, CausVid, Causal-Forcing) have Wan 2.1's weights; only the forward differs.
Nothing of the model is forked: :class:`CausalWan` wraps a loaded (optionally tensor-parallel) diffusers
``WanTransformer3DModel`` and, for the duration of a ``with`` block, installs

* in place of the model's ``rope`` module, one that returns the slice of ONE precomputed RoPE table for the whole video
  (:class:`CausalRope`), indexed by global frame: a chunk starting at frame ``s`` is encoded at its true place
  in time; the table is built once per video, never per call;
* a self-attention processor on every block's ``attn1`` that projects q/k/v, applies that RoPE and attends over
  the block's KV cache (the earlier chunks' roped keys and values, :class:`BlockKVCache`) plus the current chunk;
  during the denoising steps the chunk's K/V sit after the cache without being kept (the cache is "rolled
  back"), and the pass at timestep 0 on the clean chunk keeps them (``commit``);
* a cross-attention processor on every ``attn2`` whose text keys/values are computed once per prompt (per
  guidance branch) and reused for every later forward.

Without a cache (``use_cache=False``, the reference) a forward covers every frame so far, the clean earlier
frames at timestep 0 and the current chunk at its timestep (per-token timesteps), with a block-causal frame mask:
the queries of a chunk see the frames of that chunk and of earlier chunks inside the window. The mask then
equals the cache's view exactly, so cached and uncached sampling agree to float tolerance.

Rolling window: ``kv_window`` latent frames are attended (the current chunk included), the first ``sink``
frames pinned; a key frame ``f`` is visible to a chunk ending at frame ``e`` when ``f < e`` and
(``f < sink`` or ``f >= e - (kv_window - sink)``). Positions keep growing with the global frame index; attention
sees only their differences, which stay within the window, except the sink's distance, which grows with the
stream. Re-anchored (``CacheWindow.reanchor``), the sink's keys are turned later in time to sit right before the
oldest recent frame (``BlockKVCache.anchor_sink``), so every distance a query sees stays within the window's, as in
a video of the trained length. A rotation only adds an angle, so the cached (roped) keys are turned, not
recomputed.

How the attention itself is split (one device and tensor parallel here; Ulysses sequence parallel in
``distributed/causal_sp.py``) is a strategy object with ``attend(cache, q, k, v)`` and
``attend_masked(mask, q, k, v)``; tensor parallel needs none: each rank's ``attn.heads`` is its local head
count, so its cache holds only its heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from ..config import check_stream_options, check_stream_start, stream_chunks
from ..distributed.attention import attention
from ..distributed.context_parallel import apply_wan_rotary

__all__ = ["BlockKVCache", "CacheWindow", "CausalRope", "CausalWan", "LocalAttention", "frame_visibility"]


# --------------------------------------------------------------------------------------
# Window, RoPE table, KV cache
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheWindow:
    """Which earlier frames a chunk attends to: ``kv_window`` frames (None = all), the first ``sink`` pinned."""

    kv_window: int | None = None
    sink: int = 0
    reanchor: bool = False  # the sink sits right before the oldest recent frame (``sink_shift``)

    def sink_shift(self, chunk_end: int) -> int:
        """Frames the pinned sink is moved later in time for a chunk ending at ``chunk_end`` when re-anchored: to
        sit right before the oldest recent frame, so that it stays within the window of the chunk's queries
        however long the stream runs (0 until the window rolls, and always without re-anchoring)."""
        if not self.reanchor or not self.sink or self.kv_window is None:
            return 0
        return max(0, self.first_recent_frame(chunk_end) - self.sink)

    def first_recent_frame(self, chunk_end: int) -> int:
        """The oldest non-sink frame still visible to a chunk that ends (exclusive) at ``chunk_end``."""
        if self.kv_window is None:
            return 0
        return max(0, chunk_end - (self.kv_window - self.sink))

    def visible(self, frame: int, chunk_end: int) -> bool:
        return frame < chunk_end and (frame < self.sink or frame >= self.first_recent_frame(chunk_end))


def frame_visibility(chunks: list[tuple[int, int]], window: CacheWindow, frames: int) -> torch.Tensor:
    """[frames, frames] bool: query frame (row) may attend key frame (column) under block causality + window."""
    chunk_end = torch.empty(frames, dtype=torch.long)
    for start, length in chunks:
        chunk_end[start : start + length] = start + length
    chunk_end = chunk_end[:frames].unsqueeze(1)
    key = torch.arange(frames).unsqueeze(0)
    if window.kv_window is None:
        return key < chunk_end
    recent_from = chunk_end - (window.kv_window - window.sink)
    return (key < chunk_end) & ((key < window.sink) | (key >= recent_from))


class CausalRope:
    """Wan's RoPE (cos, sin) rows of the frames a forward covers, indexed by global frame, and the rows that turn
    roped keys later in time (re-anchoring).

    Rows are cut from the model's own ``WanRotaryPosEmbed`` frequency buffers exactly as its ``forward`` cuts
    them (so the numbers are diffusers'), but for frames ``start .. start+count`` rather than ``0 .. frames``:
    its forward can only start at frame 0, and a table of the whole video would grow with the stream (a
    480p frame's rows are about 3 MiB), where these rows stay the size of one chunk. The last rows asked for are
    kept (a chunk's denoising steps ask for the same ones)."""

    def __init__(self, model: nn.Module, frames: int, height: int, width: int):
        patch_t, patch_h, patch_w = model.config.patch_size
        rope = model.rope
        if frames // patch_t > rope.max_seq_len:
            raise ValueError(f"the video has {frames} latent frames but the model's RoPE covers "
                             f"{rope.max_seq_len}; stream at most {rope.max_seq_len} latent frames")
        # The model pads the latent to its patches (``wan.pad_inputs_to_patches``): rows cover the padded grid.
        self.grid = (-(-height // patch_h), -(-width // patch_w))
        self.tokens_per_frame = self.grid[0] * self.grid[1]
        split = [rope.t_dim, rope.h_dim, rope.w_dim]
        self._cos, self._sin = rope.freqs_cos.split(split, dim=1), rope.freqs_sin.split(split, dim=1)
        self._last: tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None
        self._last_shift: tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None

    def _cut(self, parts: tuple[torch.Tensor, ...], time: torch.Tensor) -> torch.Tensor:
        count, (rows, cols) = time.shape[0], self.grid
        pieces = [time.view(count, 1, 1, -1).expand(count, rows, cols, -1),
                  parts[1][:rows].view(1, rows, 1, -1).expand(count, rows, cols, -1),
                  parts[2][:cols].view(1, 1, cols, -1).expand(count, rows, cols, -1)]
        return torch.cat(pieces, dim=-1).reshape(1, count * rows * cols, 1, -1)

    def frames(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of frames ``start .. start+count`` ([1, count * tokens per frame, 1, head_dim] each)."""
        if self._last is None or self._last[0] != (start, count):
            rows = (self._cut(self._cos, self._cos[0][start : start + count]),
                    self._cut(self._sin, self._sin[0][start : start + count]))
            self._last = ((start, count), rows)
        return self._last[1]

    def time_shift(self, shift: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows that turn the roped keys of ``count`` frames ``shift`` frames later in time: the time part of the
        rotation by ``shift``, the height and width parts the identity (rotations add their angles). The last
        rows are kept: every block's cache turns its sink by the same shift."""
        if self._last_shift is None or self._last_shift[0] != (shift, count):
            time = lambda part: part[0][shift : shift + 1].expand(count, -1)  # noqa: E731
            ones = tuple(torch.ones_like(part) for part in self._cos)
            zeros = tuple(torch.zeros_like(part) for part in self._sin)
            self._last_shift = ((shift, count), (self._cut(ones, time(self._cos)), self._cut(zeros, time(self._sin))))
        return self._last_shift[1]

    def to(self, device: torch.device) -> "CausalRope":
        self._cos = tuple(part.to(device) for part in self._cos)
        self._sin = tuple(part.to(device) for part in self._sin)
        self._last = self._last_shift = None
        return self


class BlockKVCache:
    """One block's roped keys and plain values of earlier frames ([B, tokens, heads held here, D]).

    One preallocated buffer: the kept frames form a prefix (sink frames first, then the recent ones in order);
    ``with_chunk`` writes the current chunk's K/V right after it and returns views over both, so a denoising
    step costs no concatenation; ``commit`` keeps what was written last (the timestep-0 pass)."""

    def __init__(self, tokens_per_frame: int, capacity_frames: int):
        self.tokens_per_frame = tokens_per_frame
        self.capacity_frames = capacity_frames
        self.frame_ids: list[int] = []  # global frame index of each kept frame, in buffer order
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._written_frames: list[int] = []
        self._sink_keys: torch.Tensor | None = None  # the sink's keys as written (re-anchoring turns a copy)
        self._sink_shift = 0

    @property
    def kept_tokens(self) -> int:
        return len(self.frame_ids) * self.tokens_per_frame

    def nbytes(self) -> int:
        """The buffers, and the copy of the sink's keys that re-anchoring keeps."""
        kept = 0 if self._sink_keys is None else self._sink_keys.nbytes
        return kept + (0 if self.keys is None else self.keys.nbytes + self.values.nbytes)

    def evict(self, window: CacheWindow, chunk_end: int) -> None:
        """Drop the kept frames a chunk ending at ``chunk_end`` no longer sees (they never come back)."""
        keep = [i for i, frame in enumerate(self.frame_ids) if window.visible(frame, chunk_end)]
        if len(keep) == len(self.frame_ids):
            return
        # Kept frames are a sink prefix plus a recent suffix: copy each run down to close the gap.
        per = self.tokens_per_frame
        for slot, index in enumerate(keep):
            if slot != index:
                self.keys[:, slot * per : (slot + 1) * per] = self.keys[:, index * per : (index + 1) * per]
                self.values[:, slot * per : (slot + 1) * per] = self.values[:, index * per : (index + 1) * per]
        self.frame_ids = [self.frame_ids[i] for i in keep]

    def anchor_sink(self, window: CacheWindow, chunk_end: int, turn) -> None:
        """Re-anchoring: the kept sink frames' keys turned ``window.sink_shift(chunk_end)`` frames later in time
        (``turn(keys, shift)``), always from the keys as written, so no rounding accumulates; values have no
        position. The sink is the buffer's prefix, which eviction never moves."""
        shift = window.sink_shift(chunk_end)
        if shift == self._sink_shift:
            return
        tokens = sum(1 for frame in self.frame_ids if frame < window.sink) * self.tokens_per_frame
        if self._sink_keys is None:
            self._sink_keys = self.keys[:, :tokens].clone()
        self.keys[:, :tokens] = turn(self._sink_keys, shift)
        self._sink_shift = shift

    def with_chunk(self, keys: torch.Tensor, values: torch.Tensor, frames: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the kept frames followed by this chunk's (written after them, not kept yet)."""
        if self.keys is None:
            shape = (keys.shape[0], self.capacity_frames * self.tokens_per_frame, *keys.shape[2:])
            self.keys = keys.new_empty(shape)
            self.values = values.new_empty(shape)
        begin, end = self.kept_tokens, self.kept_tokens + keys.shape[1]
        if end > self.keys.shape[1]:
            raise RuntimeError(f"the KV cache holds {self.capacity_frames} frames; {len(self.frame_ids)} kept plus a "
                               f"chunk of {len(frames)} do not fit (evict before writing)")
        self.keys[:, begin:end] = keys
        self.values[:, begin:end] = values
        self._written_frames = list(frames)
        return self.keys[:, :end], self.values[:, :end]

    def commit(self) -> None:
        """Keep the chunk written last (the clean chunk's pass at timestep 0)."""
        self.frame_ids.extend(self._written_frames)
        self._written_frames = []


# --------------------------------------------------------------------------------------
# Attention strategies (one device / tensor parallel)
# --------------------------------------------------------------------------------------


def masked_attention(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention with a [q_len, k_len] bool mask on [B, S, H, D] tensors (PyTorch SDPA takes the mask)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


class LocalAttention:
    """The chunk's tokens all on this rank (one device, or tensor parallel over heads)."""

    def rope(self, rope: tuple[torch.Tensor, torch.Tensor], per_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return rope

    def attend(self, cache: BlockKVCache, q, k, v, frames: list[int]) -> torch.Tensor:
        keys, values = cache.with_chunk(k, v, frames)
        return attention(q, keys, values)

    def attend_masked(self, mask: torch.Tensor, q, k, v) -> torch.Tensor:
        return masked_attention(mask, q, k, v)

    def install(self, model: nn.Module) -> list:
        return []


# --------------------------------------------------------------------------------------
# Processors
# --------------------------------------------------------------------------------------


class CausalSelfAttnProcessor:
    """A block's self-attention over its KV cache (or under the frame mask); replaces ``WanAttnProcessor``."""

    def __init__(self, stream: "CausalWan", block: int):
        self.stream, self.block = stream, block

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        query, key = apply_wan_rotary(query, *rotary_emb), apply_wan_rotary(key, *rotary_emb)
        out = self.stream.self_attention(self.block, query, key, value)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(query)))


class CachedCrossAttnProcessor:
    """Text cross-attention whose keys/values are computed once per prompt and branch, then reused."""

    def __init__(self, stream: "CausalWan", block: int):
        self.stream, self.block = stream, block

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if attn.add_k_proj is not None:
            raise ValueError("streaming supports text-to-video Wan models; this model has image cross-attention (I2V)")
        cached = self.stream.cross_cache.get((self.stream.branch, self.block))
        if cached is None:
            key = attn.norm_k(attn.to_k(encoder_hidden_states)).unflatten(2, (attn.heads, -1))
            value = attn.to_v(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            cached = self.stream.cross_cache[self.stream.branch, self.block] = (key, value)
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        out = attention(query, *cached)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(query)))


# --------------------------------------------------------------------------------------
# The causal model
# --------------------------------------------------------------------------------------


class _TableRope(nn.Module):
    """Stands in for the model's ``rope`` while streaming: returns rows of the one table, computes nothing."""

    def __init__(self, stream: "CausalWan"):
        super().__init__()
        self.stream = stream

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.stream.rotary_rows()


@dataclass
class _Forward:
    """What the hooks and processors of one forward need: the frames it covers and how to attend."""

    start: int
    count: int
    commit: bool = False
    mask: torch.Tensor | None = None  # token mask of an uncached forward


@dataclass
class CausalWan:
    """A loaded Wan transformer run block-causally over chunks, with per-branch KV caches.

    Use as ``with CausalWan(model, latent_shape, chunk, ...) as causal:`` then ``causal.predict(...)`` /
    ``causal.write(...)`` per chunk; leaving the block restores the model (and its context-parallel plan)."""

    model: nn.Module
    latent_shape: tuple[int, ...]
    chunk: int
    window: CacheWindow = field(default_factory=CacheWindow)
    use_cache: bool = True
    strategy: object = field(default_factory=LocalAttention)
    branch: str = "positive"
    cross_cache: dict = field(default_factory=dict)
    start_frames: int = 0  # a start image's latent frames: the first block, written to the cache before the chunks

    def __post_init__(self):
        _, _, frames, height, width = self.latent_shape
        check_stream_options(frames, self.chunk, self.window.kv_window, self.window.sink, self.window.reanchor,
                             self.use_cache)
        check_stream_start(self.start_frames, frames, self.window.kv_window, self.window.sink)
        self.frames = frames
        self.chunks = stream_chunks(frames, self.chunk, self.start_frames)
        self.rope = CausalRope(self.model, frames, height, width).to(next(self.model.parameters()).device)
        self.caches: dict[str, list[BlockKVCache]] = {}
        self.current: _Forward | None = None
        self._frame_mask = frame_visibility(self.chunks, self.window, frames) if not self.use_cache else None
        self._undo: list = []
        self._last_mask: torch.Tensor | None = None

    # -- installation ----------------------------------------------------------------------------------

    def __enter__(self) -> "CausalWan":
        model = self.model
        context = getattr(model, "context_parallel", None)
        if context is not None:  # the bidirectional sequence split gives way to the causal one while streaming
            from ..distributed.context_parallel import context_parallel_plan

            context.remove(model)
            self._undo.append(lambda: context.install(model, context_parallel_plan(model)))
        own_rope = model.rope
        model.rope = _TableRope(self)  # the model asks for its RoPE each forward: answer from the table
        self._undo.append(lambda: setattr(model, "rope", own_rope))
        for handle in self.strategy.install(model):
            self._undo.append(handle.remove)
        for index, block in enumerate(model.blocks):
            for name, processor in (("attn1", CausalSelfAttnProcessor), ("attn2", CachedCrossAttnProcessor)):
                attn = getattr(block, name)
                self._undo.append(lambda attn=attn, old=attn.processor: attn.set_processor(old))
                attn.set_processor(processor(self, index))
        return self

    def __exit__(self, *exc_info) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    # -- what the hooks and processors ask ---------------------------------------------------------------

    def rotary_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward's rows of the precomputed table (this rank's, when the sequence is split)."""
        rows = self.rope.frames(self.current.start, self.current.count)
        return self.strategy.rope(rows, per_token=self.current.mask is not None)

    def _block_caches(self) -> list[BlockKVCache]:
        if self.branch not in self.caches:
            capacity = self.window.kv_window if self.window.kv_window is not None else self.frames
            self.caches[self.branch] = [BlockKVCache(self.rope.tokens_per_frame, min(capacity, self.frames))
                                        for _ in self.model.blocks]
        return self.caches[self.branch]

    def _make_room(self, chunk_end: int) -> None:
        """Before a cached forward of the chunk ending at ``chunk_end``: each block's cache drops what the chunk no
        longer sees and, re-anchored, turns its sink to the chunk's place."""
        for cache in self._block_caches():
            cache.evict(self.window, chunk_end)
            cache.anchor_sink(self.window, chunk_end, self._turn_later)

    def _turn_later(self, keys: torch.Tensor, shift: int) -> torch.Tensor:
        cos, sin = self.rope.time_shift(shift, keys.shape[1] // self.rope.tokens_per_frame)
        return apply_wan_rotary(keys, cos, sin)

    def self_attention(self, block: int, q, k, v) -> torch.Tensor:
        current = self.current
        if current.mask is not None:
            return self.strategy.attend_masked(current.mask, q, k, v)
        cache = self._block_caches()[block]
        out = self.strategy.attend(cache, q, k, v, list(range(current.start, current.start + current.count)))
        if current.commit:
            cache.commit()
        return out

    def cache_bytes(self) -> int:
        """Bytes of self-attention KV cache this rank holds (all branches, all blocks)."""
        return sum(cache.nbytes() for caches in self.caches.values() for cache in caches)

    # -- forwards ---------------------------------------------------------------------------------------

    def _run(self, latents: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.model(hidden_states=latents, timestep=timestep, encoder_hidden_states=context, return_dict=False)[0]

    def predict(self, chunk_latents: torch.Tensor, start: int, timestep: float, context: torch.Tensor,
                clean_before: torch.Tensor | None = None, branch: str = "positive") -> torch.Tensor:
        """The flow prediction for the chunk at frame ``start``. Cached: the chunk alone against the cache.
        Uncached: ``clean_before`` (the clean frames 0..start) is recomputed with it under the frame mask."""
        self.branch = branch
        count = chunk_latents.shape[2]
        batch = chunk_latents.shape[0]
        if self.use_cache:
            self._make_room(start + count)
            self.current = _Forward(start, count)
            t = torch.full((batch,), float(timestep), device=chunk_latents.device)
            return self._run(chunk_latents, t, context)
        latents = torch.cat([clean_before, chunk_latents], dim=2) if start else chunk_latents
        per_frame = torch.cat([torch.zeros(start), torch.full((count,), float(timestep))])
        t = per_frame.repeat_interleave(self.rope.tokens_per_frame).expand(batch, -1).to(chunk_latents.device)
        self.current = _Forward(0, start + count, mask=self._token_mask(start + count, chunk_latents.device))
        return self._run(latents, t, context)[:, :, start:]

    def _token_mask(self, frames: int, device: torch.device) -> torch.Tensor:
        """The frame mask of the first ``frames`` frames expanded to tokens; one per chunk, kept for its steps."""
        if self._last_mask is None or self._last_mask.shape[0] != frames * self.rope.tokens_per_frame:
            per = self.rope.tokens_per_frame
            mask = self._frame_mask[:frames, :frames].repeat_interleave(per, 0).repeat_interleave(per, 1)
            self._last_mask = mask.to(device)
        return self._last_mask

    def recache(self, context: torch.Tensor, earlier: list[tuple[int, torch.Tensor]], next_end: int,
                branch: str = "positive") -> int:
        """The branch's caches rebuilt under a new prompt (a prompt switch before the chunk ending at ``next_end``):
        its text cross-attention K/V dropped (the new prompt's are computed at the next forward) and its
        self-attention cache written again, chunk by chunk in order at timestep 0, from the clean ``earlier``
        chunks ((start frame, latents) each, wherever they are held) that the next chunk still sees (the sink and
        the recent window; every earlier chunk without a window): only those are moved to the context's device
        and dtype. So the recomputed keys and values carry the new prompt, and without a
        window the cache is what a stream under the new prompt from the start would hold for these frames (the
        uncached reference's recompute). Returns the chunks written (none when uncached: the reference
        recomputes every earlier frame at every step anyway)."""
        for key in [key for key in self.cross_cache if key[0] == branch]:
            del self.cross_cache[key]
        if not self.use_cache:
            return 0
        self.caches.pop(branch, None)
        seen = [(start, chunk) for start, chunk in earlier
                if any(self.window.visible(frame, next_end) for frame in range(start, start + chunk.shape[2]))]
        for start, chunk in seen:
            self.write(chunk.to(device=context.device, dtype=context.dtype), start, context, branch=branch)
        return len(seen)

    def write(self, clean_chunk: torch.Tensor, start: int, context: torch.Tensor, branch: str = "positive") -> None:
        """Keep the clean chunk's K/V in every block's cache: one forward at timestep 0 (nothing when uncached)."""
        if not self.use_cache:
            return
        self.branch = branch
        self._make_room(start + clean_chunk.shape[2])
        self.current = _Forward(start, clean_chunk.shape[2], commit=True)
        self._run(clean_chunk, torch.zeros(clean_chunk.shape[0], device=clean_chunk.device), context)
