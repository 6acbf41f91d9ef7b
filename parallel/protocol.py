"""The closed, versioned set of requests and replies between the pool driver and its workers.

Requests and replies are typed dataclasses on both sides, but what crosses a process boundary is plain data:
``{"protocol": VERSION, "kind": ..., "fields": {...}}`` with builtins only and every tensor replaced by a
transport descriptor (``{"__tensor__": ...}``). The pack's own classes are never pickled, because the driver may
know this module under another name (ComfyUI imports packs by folder name) than the worker does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from .config import (DEFAULT_SAMPLER, DEFAULT_SCHEDULER, LATENT_CHANNELS, T2V_EXPERT_BOUNDARY, check_camera_conditions, check_clip_vision_tokens, check_experts, check_image_conditioning, check_latent, check_model_forward, check_model_loras,
                     check_dtype_name, check_noise_mask, check_sampling, check_seed, check_step_range, check_time_latents, check_stream_options, check_stream_start_latent, check_stream_timesteps,
                     check_vace_contexts, check_weights_mode, check_reference_latent)
from .config import check_animate_inputs, check_prompt_switches
from .errors import ProtocolError, WorkerError  # noqa: F401  (part of the protocol: errors cross the wire)
from .cache_settings import cache_settings, check_cache, check_stream_cache

PROTOCOL_VERSION = 1
TENSOR_TAG = "__tensor__"
# The event rank 0 sends (in a progress message) when a prompt posted to a running stream is applied:
# {LIVE_PROMPT_EVENT: {"chunk": the first chunk under it, "prompt": its text}}.
LIVE_PROMPT_EVENT = "prompt_switched"

PackTensor = Callable[[torch.Tensor], Any]
UnpackTensor = Callable[[Any], torch.Tensor]


# -- message classes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    kind: ClassVar[str] = ""


@dataclass(frozen=True)
class Request(Message):
    pass


@dataclass(frozen=True)
class Reply(Message):
    pass


@dataclass(frozen=True)
class Loaded(Reply):
    kind: ClassVar[str] = "loaded"
    handle: str


@dataclass(frozen=True)
class Embeddings(Reply):
    kind: ClassVar[str] = "embeddings"
    embeddings: list[torch.Tensor]


@dataclass(frozen=True)
class Latents(Reply):
    kind: ClassVar[str] = "latents"
    latents: torch.Tensor
    expert_steps: str = ""  # sampling only: which steps each expert ran (sampling/experts.py describe_expert_steps)
    rank_timings: list[dict[str, Any]] = field(default_factory=list)  # sampling with timings: per rank, per step
    cache_report: dict[str, Any] = field(default_factory=dict)  # sampling with a step cache: steps computed/skipped


@dataclass(frozen=True)
class Images(Reply):
    kind: ClassVar[str] = "images"
    images: torch.Tensor


@dataclass(frozen=True)
class Done(Reply):
    kind: ClassVar[str] = "done"


@dataclass(frozen=True)
class HealthReport(Reply):
    """One entry per rank: rank, pid, device, loaded (handles), and what else the worker reports."""

    kind: ClassVar[str] = "health_report"
    ranks: list[dict[str, Any]]


@dataclass(frozen=True)
class DiagnosticResult(Reply):
    kind: ClassVar[str] = "diagnostic_result"
    tensors: list[torch.Tensor] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadModel(Request):
    kind: ClassVar[str] = "load_model"
    path: str
    vace_module: str | None = None
    dtype: str = "auto"
    weights: str = "keep"  # config.WEIGHT_MODES: quantized weights kept as stored, or dequantized at load

    def validate(self) -> None:
        check_dtype_name(self.dtype)
        check_weights_mode(self.weights)


@dataclass(frozen=True)
class LoadVae(Request):
    kind: ClassVar[str] = "load_vae"
    path: str
    dtype: str = "auto"

    def validate(self) -> None:
        check_dtype_name(self.dtype)


@dataclass(frozen=True)
class LoadTextEncoder(Request):
    kind: ClassVar[str] = "load_text_encoder"
    path: str
    dtype: str = "auto"

    def validate(self) -> None:
        check_dtype_name(self.dtype)


@dataclass(frozen=True)
class EncodeText(Request):
    kind: ClassVar[str] = "encode_text"
    handle: str
    prompts: list[str]


@dataclass(frozen=True)
class SampleRequest(Request):
    """One sampling run on a loaded model, used end to end: built by the nodes and the command line, checked
    in the driver, sent to the workers, read by the denoising loop. Tensors live on the CPU.

    ``guidance_scale`` is the classifier-free guidance scale (ComfyUI's "cfg"); how many ranks the guidance
    passes are split over is ``ParallelConfig.cfg_parallel``, a property of the pool, not of the request.
    """

    kind: ClassVar[str] = "sample"
    handle: str
    latent: torch.Tensor  # raw latents [B, 16, T, h, w] (Wan 2.1 VAE) or [B, 48, T, h, w] (Wan 2.2 VAE, TI2V 5B)
    positive: list[torch.Tensor]  # prompt embeddings, each [L, text_dim]
    negative: list[torch.Tensor]
    seed: int
    steps: int
    guidance_scale: float
    shift: float
    sampler: str = DEFAULT_SAMPLER  # config.SAMPLERS
    denoise: float = 1.0
    scheduler: str = DEFAULT_SCHEDULER  # config.SCHEDULERS: the sigma schedule of ComfyUI-named samplers (not wan_unipc)
    # VACE contexts in ComfyUI's native raw format, one entry per context (chained VACE encodes):
    vace_frames: list[torch.Tensor] = field(default_factory=list)  # each [1 or B, 32, T, h, w]
    vace_masks: list[torch.Tensor] = field(default_factory=list)  # each [1 or B, 64, T, h, w]
    vace_strengths: list[float] = field(default_factory=list)
    preview: bool = False  # rank 0 attaches a small RGB preview of the denoised estimate to each step's progress
    # LoRAs merged on the workers before sampling: resident model handle -> ordered [(LoRA file, strength)]
    model_loras: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    # Two experts (Wan 2.2 A14B) and step ranges (chained samplers); see sampling/experts.py for the rule:
    handle_low: str | None = None  # the low-noise expert's resident model; None: `handle` runs every step
    boundary: float = T2V_EXPERT_BOUNDARY  # steps with timestep >= boundary * 1000 run `handle`, the others `handle_low`
    guidance_scale_low: float | None = None  # the low-noise expert's guidance scale; None: guidance_scale
    start_step: int = 0  # first step run, out of `steps`
    end_step: int | None = None  # steps run stop before this one; None: steps (the result keeps leftover noise before)
    add_noise: bool = True  # False: the latent already holds the noise of step start_step (a chained second sampler)
    timings: bool = False  # every rank times its steps and collectives; the reply holds them (worker/timings.py)
    # Image-to-video, in ComfyUI's native format (WanImageToVideo's concat_latent_image, concat_mask and the CLIP
    # vision output's penultimate hidden states); the workers concatenate image_to_video.image_concat to the input
    image_latents: torch.Tensor | None = None  # raw latents of the conditioning video [rows, 16, T, h', w']
    image_mask: torch.Tensor | None = None  # [rows, 1 or 4, T' <= T, h'', w'']: 0 where a frame is given
    clip_fea: torch.Tensor | None = None  # [1 or B, 257 per image, 1280]
    # The LATENT's noise_mask as ComfyUI holds it (Wan22ImageToVideoLatent: 0 on the start image's latent frames):
    # Wan 2.2 latents only; each model call gets per-frame timesteps and the kept latent, as native KSampler does
    noise_mask: torch.Tensor | None = None  # [B, 1, T, h, w], [F, 1, H, W] or [F, H, W]; resized to the latent
    cache: dict[str, Any] | None = None  # step caching: CacheSettings' fields (sampling/step_cache.py); None: off
    # Wan 2.2 Fun (Wan22FunControlToVideo): the channel the mask goes to among the image latents (concat_mask_index)
    # and the raw reference image latent [1 or B, C, frames, h, w] (the last of reference_latents; its first frame
    # runs through the model's ref_conv)
    image_mask_index: int = 0
    reference_latent: torch.Tensor | None = None
    # ComfyUI's time_dim_concat of each pass (WanPhantomSubjectToVideo: subject latents for positive, zeros for
    # negative_img_text), raw [1 or B, C, N, h, w]; the model sees them after the sampled frames (guidance.py)
    time_latents: torch.Tensor | None = None  # the positive pass's; None: none
    time_latents_negative: torch.Tensor | None = None  # the negative pass's; None: none
    # the negative pass's own image latents and mask where they differ from the positive's (WanMoveTrackToVideo's
    # track features ride on the positive's only); None: the negative pass takes image_latents and image_mask
    image_latents_negative: torch.Tensor | None = None
    image_mask_negative: torch.Tensor | None = None  # with image_latents_negative: its mask (None: none)
    camera_conditions: torch.Tensor | None = None  # Fun Camera: WanCameraEmbedding's [1 or B, 24, T, 8h, 8w]
    # Wan 2.2 Animate of each pass (WanAnimateToVideo's pose_video_latent: raw [1 or B, 16, T', h, w]; its
    # face_video_pixels [1 or B, 3, F, 512, 512] in [-1, 1], the negative's all -1); None: that pass has none
    pose_latents: torch.Tensor | None = None
    face_pixels: torch.Tensor | None = None
    pose_latents_negative: torch.Tensor | None = None
    face_pixels_negative: torch.Tensor | None = None
    # HuMo's audio windows of each pass (WanHuMoImageToVideo's audio_embed [1 or B, T', 8, 5, 1280], the negative's
    # zeros), with a zero window for each reference frame after the video (its reference rides on time_latents)
    audio_embed: torch.Tensor | None = None
    audio_embed_negative: torch.Tensor | None = None

    def validate(self) -> None:
        """Everything that can be checked without the model; the driver calls it before sending."""
        check_sampling(sampler=self.sampler, steps=self.steps, shift=self.shift, denoise=self.denoise,
                       guidance_scale=self.guidance_scale, scheduler=self.scheduler)
        check_seed(self.seed)
        check_latent(self.latent)
        if not self.positive or not self.negative:
            raise ValueError("positive and negative conditioning must each hold at least one prompt embedding")
        check_vace_contexts(self.vace_frames, self.vace_masks, self.vace_strengths, self.latent.shape)
        check_image_conditioning(self.image_latents, self.image_mask, tuple(self.latent.shape))
        check_image_conditioning(self.image_latents_negative, self.image_mask_negative, tuple(self.latent.shape))
        if self.image_latents_negative is not None and self.image_latents is None:
            raise ValueError("the negative pass has image-to-video latents but the positive has none; pass both "
                             "through the same image-to-video node")
        check_clip_vision_tokens(self.clip_fea, self.latent.shape[0])
        check_camera_conditions(self.camera_conditions, tuple(self.latent.shape))
        check_noise_mask(self.noise_mask, tuple(self.latent.shape), self.sampler)
        check_reference_latent(self.reference_latent, self.latent.shape[0], raw=True)
        check_time_latents(self.time_latents, tuple(self.latent.shape), "positive", self.noise_mask)
        check_time_latents(self.time_latents_negative, tuple(self.latent.shape), "negative", self.noise_mask)
        check_animate_inputs(self.pose_latents, self.face_pixels, tuple(self.latent.shape))
        check_animate_inputs(self.pose_latents_negative, self.face_pixels_negative, tuple(self.latent.shape))
        check_model_loras(self.model_loras)
        check_experts(boundary=self.boundary, guidance_scale_low=self.guidance_scale_low)
        check_step_range(self.start_step, self.end_step, self.steps)
        check_cache(cache_settings(self.cache))


@dataclass(frozen=True)
class ModelForward(Request):
    """One call of a resident transformer made by a sampler that runs in the driver's process (ComfyUI's own
    samplers on the WanMesh MODEL): the flow prediction for the model input at the given timesteps. The rows go
    out as the sampler batched them (conditional and unconditional together); the pool's CFG-parallel and
    data-parallel ranks split them, tensor, ring and Ulysses ranks run each row together. Tensors on the CPU."""

    kind: ClassVar[str] = "model_forward"
    handle: str
    latent: torch.Tensor  # the model input [B, 16 / 36 / 48, T, h, w]: normalised latents (+ I2V's image channels)
    timestep: torch.Tensor  # [B] or [B, T] (per latent frame: Wan 2.2 with a noise mask): sigma x 1000
    context: torch.Tensor  # [B, L, text_dim]: prompt embeddings, one row per latent row
    vace_context: torch.Tensor | None = None  # [B, N, 96, T, h, w]: normalised VACE frames and masks, N contexts
    vace_strengths: list[float] = field(default_factory=list)  # one per VACE context
    loras: list[tuple[str, float]] = field(default_factory=list)  # (LoRA file, strength), merged before the call
    clip_fea: torch.Tensor | None = None  # [B, tokens, 1280]: CLIP vision tokens (Wan 2.1 I2V / FLF2V)
    pose_latents: torch.Tensor | None = None  # [B, 16, T', h, w]: Wan 2.2 Animate's normalised pose video latents
    face_pixels: torch.Tensor | None = None  # [B, 3, F, 512, 512]: Wan 2.2 Animate's face video in [-1, 1]
    skip_blocks: list[int] = field(default_factory=list)  # transformer blocks this call skips (skip layer guidance)
    cache: dict[str, Any] | None = None  # step caching over one sampler run's calls: CacheSettings' fields
    cache_step: int = -1  # the call's step (0-based) in the sampler's sigmas; -1: unknown (told by the timestep)
    cache_steps: int = 0  # the sampler's steps; 0: unknown
    reference_latent: torch.Tensor | None = None  # [B, C, h, w]: Wan 2.2 Fun's normalised reference (ref_conv)
    camera_conditions: torch.Tensor | None = None  # [1 or B, 24, T, 8h, 8w]: the Fun Camera embedding
    audio_embed: torch.Tensor | None = None  # [1 or B, T, 8, 5, 1280]: HuMo's audio windows, one per latent frame

    def validate(self) -> None:
        check_cache(cache_settings(self.cache))
        check_reference_latent(self.reference_latent, self.latent.shape[0], raw=False)
        check_model_forward(self.latent, self.timestep, self.context, self.vace_context, self.vace_strengths,
                            self.clip_fea)
        check_animate_inputs(self.pose_latents, self.face_pixels, tuple(self.latent.shape))
        check_camera_conditions(self.camera_conditions, tuple(self.latent.shape))
        check_model_loras({self.handle: self.loras})


@dataclass(frozen=True)
class StreamSample(Request):
    """One causal (chunk by chunk) streaming run: sampled with a KV cache, each finished chunk reported by rank 0
    with its raw latents and, when ``vae_handle`` names a loaded VAE, its frames decoded by the streaming VAE.

    ``latent`` is the empty latent [B, 16, T, h, w] whose shape gives the video's size; ``negative`` may be
    empty (no guidance); ``timesteps`` (0..1000, descending) replaces the ``steps``/``shift`` schedule."""

    kind: ClassVar[str] = "stream_sample"
    handle: str
    latent: torch.Tensor
    positive: list[torch.Tensor]
    negative: list[torch.Tensor]
    seed: int
    steps: int = 4
    shift: float = 5.0
    timesteps: list[float] | None = None
    guidance_scale: float = 1.0
    chunk: int = 3
    kv_window: int | None = None  # latent frames kept in the cache; None = the whole video
    sink: int = 0
    reanchor: bool = False  # the sink turned to sit right before the window's oldest frame (networks/causal.py)
    use_cache: bool = True
    vae_handle: str | None = None
    preview: bool = True  # rank 0 sends each finished chunk (latents and decoded frames) with its progress
    start_latent: torch.Tensor | None = None  # raw [1 or B, 16, n, h, w]: the start image's latents (first block)
    cache: dict[str, Any] | None = None  # step caching within each chunk: CacheSettings' fields; None: off
    # prompt switches: before chunk switch_chunks[i] the positive prompt becomes switch_positive[i] (embeddings as
    # ``positive``); the caches are rebuilt under it (sampling/stream.py)
    switch_chunks: list[int] = field(default_factory=list)
    switch_positive: list[list[torch.Tensor]] = field(default_factory=list)
    # prompts posted while the stream runs (``live`` messages to rank 0) are encoded by this loaded text encoder on
    # every rank and switched to at the next chunk boundary; None: the stream takes no posted prompts
    live_text_encoder: str | None = None

    def validate(self) -> None:
        check_cache(cache_settings(self.cache))
        check_stream_cache(cache_settings(self.cache), self.use_cache)
        check_sampling(sampler="euler", steps=self.steps, shift=self.shift, denoise=1.0,
                       guidance_scale=self.guidance_scale)
        check_seed(self.seed)
        check_latent(self.latent, (LATENT_CHANNELS,))  # the causal checkpoints are Wan 2.1 models
        check_stream_options(self.latent.shape[2], self.chunk, self.kv_window, self.sink, self.reanchor, self.use_cache)
        if self.start_latent is not None:
            check_stream_start_latent(self.start_latent, tuple(self.latent.shape), self.kv_window, self.sink)
        check_stream_timesteps(self.timesteps)
        if len(self.switch_chunks) != len(self.switch_positive) or not all(self.switch_positive):
            raise ValueError(f"{len(self.switch_chunks)} prompt switch chunks but {len(self.switch_positive)} "
                             "prompts; give one prompt embedding (or one per batch row) for each switch")
        start_frames = 0 if self.start_latent is None else self.start_latent.shape[2]
        check_prompt_switches(self.switch_chunks, self.latent.shape[2], self.chunk, start_frames)
        if not self.positive:
            raise ValueError("positive conditioning must hold at least one prompt embedding")
        if self.guidance_scale != 1.0 and not self.negative:
            raise ValueError(f"guidance scale {self.guidance_scale} needs negative conditioning; connect a negative "
                             "prompt or set cfg to 1")


@dataclass(frozen=True)
class Streamed(Reply):
    """The whole streamed video: raw latents [B, 16, T, h, w] and, with a VAE, frames [B*F, H, W, 3] in 0..1."""

    kind: ClassVar[str] = "streamed"
    latents: torch.Tensor
    frames: torch.Tensor | None = None
    cache_report: dict[str, Any] = field(default_factory=dict)  # with a step cache: steps computed/skipped


@dataclass(frozen=True)
class EncodeVace(Request):
    """VACE inputs -> ComfyUI's native VACE conditioning tensors, VAE-encoded on the pool (``vace/encode.py``)."""

    kind: ClassVar[str] = "encode_vace"
    handle: str  # the VAE
    width: int
    height: int
    length: int
    control_video: torch.Tensor | None = None  # IMAGE [F, H, W, C]
    control_masks: torch.Tensor | None = None  # MASK [F, H, W]
    reference_images: torch.Tensor | None = None  # IMAGE [R, H, W, C], one latent frame each
    tile_px: int | None = None
    overlap_px: int | None = None


@dataclass(frozen=True)
class VaceEncoded(Reply):
    kind: ClassVar[str] = "vace_encoded"
    frames: torch.Tensor  # [1, 32, R+T, h, w] raw
    mask: torch.Tensor  # [1, 64, R+T, h, w]
    trim_latent: int


@dataclass(frozen=True)
class Decode(Request):
    kind: ClassVar[str] = "decode"
    handle: str
    latents: torch.Tensor
    tile_px: int | None = None  # None: whole frames (or the default tile when vae_patch > 1)
    overlap_px: int | None = None  # None: a quarter of the tile


@dataclass(frozen=True)
class Encode(Request):
    kind: ClassVar[str] = "encode"
    handle: str
    frames: torch.Tensor
    tile_px: int | None = None
    overlap_px: int | None = None


@dataclass(frozen=True)
class Unload(Request):
    """Unload one handle, or everything when ``handle`` is None."""

    kind: ClassVar[str] = "unload"
    handle: str | None = None


@dataclass(frozen=True)
class Health(Request):
    kind: ClassVar[str] = "health"


@dataclass(frozen=True)
class Calibrate(Request):
    """Measure this pool's speeds and links for the auto layout (``calibration.py``), every rank at once."""

    kind: ClassVar[str] = "calibrate"


@dataclass(frozen=True)
class Calibrated(Reply):
    kind: ClassVar[str] = "calibrated"
    ranks: list[dict[str, Any]]  # each rank's figures, in rank order


@dataclass(frozen=True)
class Shutdown(Request):
    kind: ClassVar[str] = "shutdown"


@dataclass(frozen=True)
class Diagnostic(Request):
    """Diagnostics, not inference: ``op="echo"`` sends ``tensors`` back (the transport benchmark uses it);
    ``op="modules"`` lists the modules the worker has loaded; further ops exist only when the pool was started
    with a diagnostics file (fault-injection tests)."""

    kind: ClassVar[str] = "diagnostic"
    op: str
    args: dict[str, Any] = field(default_factory=dict)
    tensors: list[torch.Tensor] = field(default_factory=list)


REQUESTS: dict[str, type[Request]] = {
    cls.kind: cls
    for cls in (LoadModel, LoadVae, LoadTextEncoder, EncodeText, SampleRequest, EncodeVace, Decode, Encode, Unload, Health, Shutdown, Diagnostic, StreamSample,
                ModelForward, Calibrate)
}
REPLIES: dict[str, type[Reply]] = {
    cls.kind: cls for cls in (Loaded, Embeddings, Latents, Images, VaceEncoded, Done, HealthReport, DiagnosticResult, Streamed, Calibrated)
}
REPLY_TO: dict[type[Request], type[Reply]] = {
    LoadModel: Loaded, LoadVae: Loaded, LoadTextEncoder: Loaded, EncodeText: Embeddings, SampleRequest: Latents, EncodeVace: VaceEncoded,
    Decode: Images, Encode: Latents, Unload: Done, Health: HealthReport, Shutdown: Done, Diagnostic: DiagnosticResult,
    StreamSample: Streamed, ModelForward: Latents, Calibrate: Calibrated,
}
LOADS = (LoadModel, LoadVae, LoadTextEncoder)


# -- plain-data encoding -------------------------------------------------------------------------------


def _to_plain(value: Any, pack: PackTensor, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        return {TENSOR_TAG: pack(value)}
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (list, tuple)):
        return [_to_plain(v, pack, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ProtocolError(f"{where}: dictionary keys must be strings")
        return {k: _to_plain(v, pack, f"{where}.{k}") for k, v in value.items()}
    raise ProtocolError(f"{where}: {type(value).__name__} cannot cross the worker boundary (plain data and tensors only)")


def _from_plain(value: Any, unpack: UnpackTensor) -> Any:
    if isinstance(value, dict):
        if TENSOR_TAG in value:
            return unpack(value[TENSOR_TAG])
        return {k: _from_plain(v, unpack) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_plain(v, unpack) for v in value]
    return value


def encode_message(message: Message, pack: PackTensor) -> dict[str, Any]:
    """A request or reply as plain data; ``pack`` turns each tensor into a transport descriptor."""
    if type(message).kind not in REQUESTS and type(message).kind not in REPLIES:
        raise ProtocolError(f"{type(message).__name__} is not a message of protocol version {PROTOCOL_VERSION}")
    fields = {
        f.name: _to_plain(getattr(message, f.name), pack, f"{message.kind}.{f.name}") for f in dataclasses.fields(message)
    }
    return {"protocol": PROTOCOL_VERSION, "kind": message.kind, "fields": fields}


def decode_message(data: dict[str, Any], unpack: UnpackTensor) -> Message:
    """The typed message for plain data made by :func:`encode_message`; unknown versions, kinds or fields fail."""
    if not isinstance(data, dict) or data.get("protocol") != PROTOCOL_VERSION:
        version = data.get("protocol") if isinstance(data, dict) else None
        raise ProtocolError(f"protocol version {version!r} received, this side speaks version {PROTOCOL_VERSION}")
    kind = data.get("kind")
    cls = REQUESTS.get(kind) or REPLIES.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}; known: {', '.join([*REQUESTS, *REPLIES])}")
    fields = data.get("fields", {})
    names = {f.name for f in dataclasses.fields(cls)}
    if set(fields) - names:
        raise ProtocolError(f"{kind}: unknown fields {sorted(set(fields) - names)}; valid: {sorted(names)}")
    try:
        return cls(**{name: _from_plain(value, unpack) for name, value in fields.items()})
    except TypeError as exc:
        raise ProtocolError(f"{kind}: {exc}") from None


def tensors_in(message: Message) -> list[torch.Tensor]:
    """Every tensor a message carries (to size transfers up front)."""
    found: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    for f in dataclasses.fields(message):
        walk(getattr(message, f.name))
    return found
