"""ParallelConfig and every check of user-given numbers, written once; runs in the driver (and workers).

ParallelConfig is how many ranks the worker pool has and how they split the work.

The rank layout is ``world = dp x cfg x ulysses x ring x tp`` with ``tp`` varying fastest, so tensor-parallel
peers are neighbours (and share a machine on a cluster). ``cfg`` is 2 with CFG parallel (conditional and
unconditional passes on two halves of the pool) and ``dp`` (data-parallel replicas that split the batch) fills
whatever the other degrees leave; with a batch of one the extra replicas still share the VAE patch work.

Everything here is checked up front, before a process starts, with messages that name the numbers. The
video geometry (sizes, frame counts, latent shapes, VAE tiles), the sampling settings and the head-count
divisibility of the parallel degrees are checked here too, so every caller (nodes, command line, workers)
gives the same one-line error. Light at import: plain Python only (torch is imported where a tensor is checked).
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BACKENDS = ("local", "ray")
LAYOUT_MODES = ("manual", "auto")  # auto: auto_layout.py picks the degrees for the job
MESH_DIMS = ("dp", "cfg", "ulysses", "ring", "tp")  # outermost first; tp varies fastest; cfg = the CFG-parallel split
# Samplers the workers run. euler .. uni_pc equal ComfyUI's same-named samplers with the scheduler chosen from
# SCHEDULERS (ComfyUI's names); wan_unipc is Wan's reference flow UniPC (its own schedule, shift only), and
# "unipc", its older name, still selects it.
WAN_UNIPC, WAN_UNIPC_ALIAS = "wan_unipc", "unipc"
COMFY_SAMPLERS = ("euler", "euler_ancestral", "dpmpp_2m", "lcm", "uni_pc")
DISCARD_PENULTIMATE_SIGMA = ("uni_pc",)  # ComfyUI schedules these one step longer and drops the next-to-last sigma
SAMPLERS = (WAN_UNIPC_ALIAS, *COMFY_SAMPLERS, WAN_UNIPC)
DEFAULT_SAMPLER, DEFAULT_SCHEDULER = "uni_pc", "simple"  # what ComfyUI's native Wan workflows sample with
SCHEDULERS = ("simple", "normal", "beta", "sgm_uniform", "karras")
DTYPE_NAMES = ("auto", "fp32", "bf16", "fp16")
TEXT_TOKENS = 512  # Wan's text length: prompt embeddings are padded (or cut) to it; tokens past it are dropped
T2V_EXPERT_BOUNDARY = 0.875  # Wan 2.2 A14B: steps with timestep >= boundary x 1000 run the high-noise expert (T2V)
I2V_EXPERT_BOUNDARY = 0.9  # the same for Wan 2.2 I2V A14B
# How a quantized transformer file (fp8, scaled fp8, GGUF) is held on each rank: "keep" holds the stored blocks and
# dequantizes each linear weight for its own matmul; "dequantize" expands every weight to the compute dtype at load.
WEIGHT_MODES = ("keep", "dequantize")
CONTROL_MODES = ("canny", "scribble", "gray", "flow", "none")  # what a VACE control video is made from a video
SPATIAL_STRIDE = 16  # VAE 8x times the transformer's 2x2 patches (VACE sizes; other sizes are padded to patches)
VAE_SPATIAL_FACTOR = 8
TEMPORAL_STRIDE = 4  # frames are 4k + 1
# The two Wan latent spaces (the channel facts, once): the Wan 2.1 VAE's 16 channels at 8x (Wan 2.1 models, Wan 2.2
# A14B) and the Wan 2.2 VAE's 48 channels at 16x (Wan 2.2 TI2V 5B). LATENT_CHANNELS alone means the Wan 2.1 one.
LATENT_CHANNELS = 16
WAN22_LATENT_CHANNELS = 48
WAN22_VAE_SPATIAL_FACTOR = 16
LATENT_CHANNEL_COUNTS = (LATENT_CHANNELS, WAN22_LATENT_CHANNELS)
LATENT_SPATIAL_FACTORS = {LATENT_CHANNELS: VAE_SPATIAL_FACTOR, WAN22_LATENT_CHANNELS: WAN22_VAE_SPATIAL_FACTOR}


def latent_spatial_factor(channels: int) -> int:
    """Pixels per latent along each spatial axis for a latent of ``channels``: 16 for the Wan 2.2 VAE's 48, else
    the Wan 2.1 VAE's 8 (image-to-video inputs carry its 16 channels plus mask and image channels)."""
    return LATENT_SPATIAL_FACTORS.get(channels, VAE_SPATIAL_FACTOR)

CLIP_VISION_TOKENS = 257  # per image: ViT-H/14 at 224 px, 16 x 16 patches and the class token (Wan 2.1 I2V / FLF2V)
# The Wan 2.2 VAE's latent mean/std (ComfyUI's Wan22 latent format, diffusers' Wan 2.2 VAE config.json). Written out
# because diffusers' AutoencoderKLWan defaults hold only the Wan 2.1 values (sampling/latents.py reads those).
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)
NATIVE_DECODE_OVERLAP_SHARE = 4  # VAEDecodeTiled lowers an overlap above tile / 4 to tile / 4
DEFAULT_WORKER_TIMEOUT_S = 60.0
MIN_WORKER_TIMEOUT_S = 1.0  # heartbeats come every second: a shorter timeout would flag healthy ranks
MAX_HEARTBEAT_S = 1.0


def cache_root() -> Path:
    """WanMesh's cache folder (the tiny models, the machine calibration): ``$WANMESH_CACHE``, else
    ``$XDG_CACHE_HOME/wanmesh`` or ``~/.cache/wanmesh``."""
    base = os.environ.get("WANMESH_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"),
                                                           "wanmesh")
    return Path(base)


def heartbeat_interval(worker_timeout: float) -> float:
    """How often a busy worker beats: every second, or four times per timeout when the timeout is shorter (so
    one late beat is not a stuck rank). Read by the workers (local and Ray) and by the driver that watches them."""
    return min(MAX_HEARTBEAT_S, worker_timeout / 4)


def _as_device_tuple(devices: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Expand the user's device spec: 'cpu:N' is N CPU ranks; in 'cuda:0,1,2' bare numbers inherit 'cuda:'."""
    parts = devices.split(",") if isinstance(devices, str) else [str(d) for d in devices]
    expanded: list[str] = []
    for part in (p.strip() for p in parts if p.strip()):
        kind, _, count = part.partition(":")
        if kind == "cpu" and count:
            if not count.isdigit() or int(count) < 1:
                raise ValueError(f"device {part!r} is not valid; 'cpu:N' needs a positive rank count N")
            expanded += ["cpu"] * int(count)
        elif part.isdigit() and expanded and expanded[-1].startswith("cuda:"):
            expanded.append(f"cuda:{part}")
        else:
            expanded.append(part)
    return tuple(expanded)


def _cpu_rank_count(devices: str | list[str] | tuple[str, ...]) -> int | None:
    """N when the whole device spec is 'cpu:N' (N CPU ranks, which must be the world), else None."""
    if not isinstance(devices, str):
        return None
    kind, sep, count = devices.strip().partition(":")
    return int(count) if kind == "cpu" and sep and count.isdigit() and int(count) >= 1 else None


@dataclass(frozen=True)
class ParallelConfig:
    """The pool's shape. Immutable and hashable: equal configs share one pool (see ``pool.get_pool``).

    ``devices``: ``"auto"`` (every rank on its own GPU when CUDA is present, else CPU ranks), ``"cpu"``,
    ``"cuda"`` (``cuda:0 .. cuda:world-1``), or an explicit list such as ``"cuda:0,cuda:2"`` (the first
    ``world`` entries are used). ``ray_address`` is only read by the ``ray`` backend (``None``: ``"auto"``).
    """

    world: int = 1
    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    cfg_parallel: bool = False
    vae_patch: int = 1  # ranks that share VAE tiles (capped at the pool size when used)
    devices: tuple[str, ...] = ("auto",)
    backend: str = "local"
    ray_address: str | None = None
    memory_budget_gb: float = 0.0  # resident models per rank; 0 = what the device can hold (residency.py)
    worker_timeout: float = DEFAULT_WORKER_TIMEOUT_S  # seconds a rank may go silent (no heartbeat) or block in a collective

    def __post_init__(self) -> None:
        cpu_ranks = _cpu_rank_count(self.devices)
        object.__setattr__(self, "devices", _as_device_tuple(self.devices))
        self._check_degrees()
        if cpu_ranks is not None and cpu_ranks != self.world:
            raise ValueError(f"devices cpu:{cpu_ranks} asks for {cpu_ranks} CPU rank{'s' * (cpu_ranks != 1)} but "
                             f"world={self.world}; valid: world={cpu_ranks}, or devices cpu:{self.world} (or 'cpu', "
                             "which fits any world)")
        self._check_devices_spec()
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is unknown; valid backends: {', '.join(BACKENDS)}")
        check_memory_budget(self.memory_budget_gb)
        check_worker_timeout(self.worker_timeout)

    # -- derived degrees ----------------------------------------------------------------------------------

    @property
    def cfg_degree(self) -> int:
        """Ranks the CFG passes are split over: 2 with CFG parallel, else 1 (not the guidance scale)."""
        return 2 if self.cfg_parallel else 1

    @property
    def model_parallel(self) -> int:
        """Ranks that cooperate on one denoising pass: cfg x ulysses x ring x tp."""
        return self.cfg_degree * self.ulysses * self.ring * self.tp

    @property
    def dp(self) -> int:
        return self.world // self.model_parallel

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes along ``MESH_DIMS``."""
        return (self.dp, self.cfg_degree, self.ulysses, self.ring, self.tp)

    # -- checks -------------------------------------------------------------------------------------------

    def _check_degrees(self) -> None:
        for name in ("world", "tp", "ulysses", "ring", "vae_patch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        product = self.model_parallel
        if self.world % product:
            factors = f"cfg x ulysses x ring x tp = {self.cfg_degree} x {self.ulysses} x {self.ring} x {self.tp} = {product}"
            valid = ", ".join(str(product * k) for k in range(1, 5))
            raise ValueError(
                f"world={self.world} is not a multiple of {factors}; with these degrees valid worlds are {valid}, ... "
                "(the data-parallel degree dp fills the rest)"
            )

    def _check_devices_spec(self) -> None:
        if not self.devices:
            raise ValueError("devices is empty; valid: 'auto', 'cpu', 'cuda' or a list such as 'cuda:0,cuda:1'")
        if len(self.devices) == 1 and self.devices[0] in ("auto", "cpu", "cuda"):
            return
        for device in self.devices:
            kind, _, index = device.partition(":")
            if kind not in ("cpu", "cuda") or (kind == "cuda" and not index.isdigit()):
                raise ValueError(
                    f"device {device!r} in devices={','.join(self.devices)} is not valid; use 'cpu' or 'cuda:N' entries, "
                    "or one of 'auto', 'cpu', 'cuda'"
                )
        cuda = [d for d in self.devices if d != "cpu"]
        if len(set(cuda)) != len(cuda):
            raise ValueError(f"devices={','.join(self.devices)} names a GPU twice; each rank needs its own GPU")
        if len(self.devices) < self.world:
            raise ValueError(
                f"world={self.world} ranks but only {len(self.devices)} devices are listed ({','.join(self.devices)}); "
                "list one device per rank or lower world"
            )

    def check_heads(self, num_heads: int) -> None:
        """Attention heads are split over tp x ulysses ranks: fail when a loaded model cannot be split so."""
        check_head_split(num_heads, tp=self.tp, ulysses=self.ulysses)

    def rank_devices(self, cuda_count: int | None = None) -> list[str]:
        """The device of each rank on this machine (local backend), ``cuda:N`` being the machine's N-th GPU.
        ``cuda_count``: the machine's GPUs (default: ``gpus.machine_gpus``, which a host's narrowed
        ``CUDA_VISIBLE_DEVICES`` does not hide)."""
        spec = self.devices
        if cuda_count is None and any(d != "cpu" for d in spec):
            from .gpus import machine_gpus

            cuda_count = machine_gpus().count
        cuda_count = cuda_count or 0
        if spec == ("auto",):
            spec = ("cuda",) if cuda_count > 0 else ("cpu",)
        if spec == ("cpu",):
            return ["cpu"] * self.world
        if spec == ("cuda",):
            if self.world > cuda_count:
                fix = f"lower world to at most {cuda_count}" if cuda_count else "no GPU is visible: use devices='cpu'"
                raise ValueError(f"world={self.world} ranks need {self.world} GPUs but {cuda_count} are visible; {fix}")
            return [f"cuda:{i}" for i in range(self.world)]
        chosen = list(spec[: self.world])
        missing = [d for d in chosen if d.startswith("cuda:") and int(d.split(":")[1]) >= cuda_count]
        if missing:
            raise ValueError(f"devices {', '.join(missing)} do not exist: this machine has {cuda_count} GPUs "
                             f"(valid: cuda:0..cuda:{cuda_count - 1})" if cuda_count else
                             f"devices {', '.join(missing)} do not exist: no GPU is visible; use devices='cpu'")
        return chosen

    # -- plain data (crosses process boundaries; the pack's classes never do) -----------------------------

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["devices"] = list(self.devices)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ParallelConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown ParallelConfig fields {sorted(unknown)}; valid: {sorted(known)}")
        return cls(**data)

    def describe(self) -> str:
        parts = [f"world={self.world}"] + [f"{n}={s}" for n, s in zip(MESH_DIMS, self.mesh_shape) if s > 1]
        return " ".join(parts) + f" devices={','.join(self.devices)} backend={self.backend}"


def rank_coordinates(config: ParallelConfig, rank: int) -> dict[str, int]:
    """This rank's index along each mesh dimension (row-major over ``MESH_DIMS``, tp fastest)."""
    if not 0 <= rank < config.world:
        raise ValueError(f"rank {rank} is outside world={config.world}")
    coords: dict[str, int] = {}
    remainder = rank
    for name, size in zip(reversed(MESH_DIMS), reversed(config.mesh_shape)):
        coords[name] = remainder % size
        remainder //= size
    return {name: coords[name] for name in MESH_DIMS}



# -- head split ------------------------------------------------------------------------------------------


def check_worker_timeout(seconds) -> None:
    """The heartbeat / collective timeout: a finite number of seconds, at least MIN_WORKER_TIMEOUT_S."""
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds) \
            or seconds < MIN_WORKER_TIMEOUT_S:
        raise ValueError(f"worker_timeout must be a finite number of seconds >= {MIN_WORKER_TIMEOUT_S:g}, "
                         f"got {seconds!r} (default {DEFAULT_WORKER_TIMEOUT_S:g})")


def _divisors(value: int) -> str:
    return ", ".join(str(d) for d in range(1, value + 1) if value % d == 0)


def check_head_split(num_heads: int, *, tp: int = 1, ulysses: int = 1, ffn_dim: int | None = None) -> None:
    """Tensor parallelism splits whole heads (and the FFN width); Ulysses splits each tp rank's heads again."""
    for name, degree in (("tp", tp), ("ulysses", ulysses)):
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ValueError(f"{name} must be a positive integer, got {degree!r}")
    split = tp * ulysses
    if num_heads % split and ulysses == 1:
        raise ValueError(
            f"tp={tp} does not divide the model's {num_heads} attention heads; tensor parallelism splits whole "
            f"heads, so tp must divide {num_heads} (one of {_divisors(num_heads)})"
        )
    if num_heads % split:
        raise ValueError(
            f"the model has {num_heads} attention heads, which do not divide over tp x ulysses = "
            f"{tp} x {ulysses} = {split} ranks; tp x ulysses must divide {num_heads} (one of {_divisors(num_heads)})"
        )
    if ffn_dim is not None and ffn_dim % tp:
        raise ValueError(
            f"tp={tp} does not divide the model's FFN width {ffn_dim}; valid tp for this model: "
            f"{_divisors(math.gcd(num_heads, ffn_dim))}"
        )


# -- video geometry ----------------------------------------------------------------------------------------


def _nearest(value: int, step: int, offset: int, minimum: int) -> str:
    """The valid values of the form step*k + offset (at least ``minimum``) just below and above ``value``."""
    below = (value - offset) // step * step + offset
    candidates = [v for v in (below, below + step) if v >= minimum] or [minimum]
    return " or ".join(str(v) for v in dict.fromkeys(candidates))


def _is_whole(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_frame_count(frames: int, what: str = "frame count") -> None:
    if not _is_whole(frames) or frames < 1 or (frames - 1) % TEMPORAL_STRIDE:
        near = _nearest(int(frames), TEMPORAL_STRIDE, 1, 1) if _is_whole(frames) else "1, 5, 9, ..."
        raise ValueError(f"{what} {frames!r} is not of the form 4k+1 (nearest valid: {near})")


def check_frame_size(width: int, height: int, multiple: int = SPATIAL_STRIDE, where: str = "") -> None:
    """Width and height that are positive multiples of ``multiple``, naming the nearest valid values."""
    problems = []
    for name, value in (("width", width), ("height", height)):
        if not _is_whole(value) or value < multiple or value % multiple:
            near = _nearest(int(value), multiple, 0, multiple) if _is_whole(value) else f"{multiple}, {2 * multiple}, ..."
            problems.append(f"{where}{name} {value!r} is not a positive multiple of {multiple} (nearest valid: {near})")
    if problems:
        raise ValueError("; ".join(problems))


def check_video_size(width: int, height: int, frames: int, multiple: int = VAE_SPATIAL_FACTOR) -> None:
    """Reject sizes Wan cannot make exactly (sizes multiples of 8, 4k+1 frames), naming the nearest valid values,
    before any work starts."""
    problems = []
    for check in (lambda: check_frame_size(width, height, multiple), lambda: check_frame_count(frames)):
        try:
            check()
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise ValueError("; ".join(problems))


def check_encode_frames(width: int, height: int, frames: int) -> None:
    """Frames a VAE encode takes, as native VAEEncode: at least one frame of at least 8x8 pixels (a size that is not
    a multiple of 8 is centre-cropped, frames past the last 4k+1 are dropped: ``encode_geometry``)."""
    problems = [f"{name} {value!r} is smaller than the VAE's {VAE_SPATIAL_FACTOR} pixels (valid: {VAE_SPATIAL_FACTOR} "
                f"or more)" for name, value in (("width", width), ("height", height))
                if not _is_whole(value) or value < VAE_SPATIAL_FACTOR]
    if not _is_whole(frames) or frames < 1:
        problems.append(f"frame count {frames!r} is not a positive number of frames (valid: 1 or more)")
    if problems:
        raise ValueError("; ".join(problems))


def encode_geometry(width: int, height: int, frames: int) -> tuple[slice, slice, int]:
    """(rows, columns, frames) a VAE encode uses of a video, as native VAEEncode: each size cut to a multiple of 8
    around the centre (offset: half the remainder, rounded down) and the first 1 + 4k frames, the most the causal
    encoder's 1, 4, 4, ... frame chunks take."""
    check_encode_frames(width, height, frames)

    def centre(size: int) -> slice:
        kept = size // VAE_SPATIAL_FACTOR * VAE_SPATIAL_FACTOR
        start = (size - kept) // 2
        return slice(start, start + kept)

    return centre(height), centre(width), (frames - 1) // TEMPORAL_STRIDE * TEMPORAL_STRIDE + 1


def latent_shape(width: int, height: int, frames: int, batch: int = 1) -> tuple[int, int, int, int, int]:
    """The raw Wan latent shape [B, 16, T, H/8, W/8] of a video; bad sizes are refused first."""
    check_video_size(width, height, frames)
    return (batch, LATENT_CHANNELS, (frames - 1) // TEMPORAL_STRIDE + 1, height // VAE_SPATIAL_FACTOR,
            width // VAE_SPATIAL_FACTOR)


def check_latent(latent, channels: tuple[int, ...] = LATENT_CHANNEL_COUNTS) -> None:
    """A latent the transformer can take: [B, 16, T, H/8, W/8] (Wan 2.1 VAE) or [B, 48, T, H/16, W/16] (Wan 2.2
    VAE, TI2V 5B) of any positive size (the model pads h and w to its 2x2 patches and crops its output back, as
    native Wan does). ``channels``: the channel counts the caller takes."""
    if latent.ndim != 5 or latent.shape[1] not in channels or min(latent.shape) < 1:
        valid = " or ".join(f"[B, {c}, T, H/{LATENT_SPATIAL_FACTORS[c]}, W/{LATENT_SPATIAL_FACTORS[c]}]"
                            for c in channels)
        raise ValueError(f"latent must be {valid} raw Wan latents, got shape {list(latent.shape)}")


def resolve_tile_options(tile_px: int, overlap_px: int | None, ratio: int = VAE_SPATIAL_FACTOR, *,
                         decode: bool = False) -> tuple[int, int]:
    """Validate the tile edge and overlap (pixels); the overlap defaults to a quarter tile, a multiple of ``ratio``.

    A decode takes them as native ``VAEDecodeTiled`` does: an overlap above a quarter of the tile becomes a quarter
    of it, and both are cut down to multiples of ``ratio`` (native divides them by the VAE's factor). An encode
    (native ``VAEEncodeTiled`` keeps any overlap below the tile) takes an overlap of at most half the tile, the most
    the linear blend of neighbouring tiles covers."""
    if isinstance(tile_px, bool) or not isinstance(tile_px, int) or tile_px < ratio or (tile_px % ratio and not decode):
        raise ValueError(f"tile_px must be a positive multiple of the VAE's spatial factor {ratio}, got {tile_px!r}")
    if decode and overlap_px is not None and (isinstance(overlap_px, bool) or not isinstance(overlap_px, int)
                                              or overlap_px < 0):
        raise ValueError(f"overlap_px must be a whole number of pixels >= 0, got {overlap_px!r}")
    if overlap_px is None:
        overlap_px = (tile_px // NATIVE_DECODE_OVERLAP_SHARE) // ratio * ratio
    elif decode and tile_px < overlap_px * NATIVE_DECODE_OVERLAP_SHARE:
        overlap_px = tile_px // NATIVE_DECODE_OVERLAP_SHARE
    if decode:
        return tile_px // ratio * ratio, overlap_px // ratio * ratio
    if not isinstance(overlap_px, int) or overlap_px % ratio or not 0 <= overlap_px <= tile_px // 2:
        raise ValueError(
            f"overlap_px must be a multiple of {ratio} between 0 and half the tile ({tile_px // 2}), got {overlap_px!r}"
        )
    return tile_px, overlap_px


def check_tiles(tile_px: int | None, overlap_px: int | None, *, decode: bool = False) -> None:
    """The user's VAE tile options (None: no tiling), before any worker work."""
    if tile_px is not None:
        resolve_tile_options(tile_px, overlap_px, decode=decode)
    elif overlap_px is not None:
        raise ValueError("an overlap was given without a tile size; give the tile size too")


# -- sampling settings -------------------------------------------------------------------------------------


def check_sampling(*, sampler: str, steps: int, shift: float, denoise: float, guidance_scale: float = 1.0,
                   scheduler: str = SCHEDULERS[0]) -> None:
    """The denoising settings, before any worker work."""
    if not math.isfinite(guidance_scale) or guidance_scale < 0:
        raise ValueError(f"the guidance scale (cfg) must be a finite number >= 0, got {guidance_scale}; 1 runs a "
                         "single pass, Wan's default is 5")
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler {sampler!r} is unknown; valid samplers: {', '.join(SAMPLERS)}")
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler {scheduler!r} is unknown; valid schedulers: {', '.join(SCHEDULERS)}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if not 0.0 < denoise <= 1.0:
        raise ValueError(f"denoise must be in (0, 1], got {denoise}")
    if not math.isfinite(shift) or shift <= 0:
        raise ValueError(f"shift must be a positive finite number, got {shift}")


# -- VACE conditioning -------------------------------------------------------------------------------------

VACE_FRAME_CHANNELS, VACE_MASK_CHANNELS = 32, 64


def check_vace_contexts(frames: list, masks: list, strengths: list, latent_shape: tuple) -> None:
    """Native VACE conditioning (one entry per context) that fits the latent it is sampled with."""
    if not len(frames) == len(masks) == len(strengths):
        raise ValueError(f"VACE conditioning needs as many masks and strengths as contexts; got {len(frames)} "
                         f"vace_frames, {len(masks)} vace_mask and {len(strengths)} vace_strength")
    batch, _, *positions = latent_shape
    for index, (frame, mask, strength) in enumerate(zip(frames, masks, strengths)):
        for name, tensor, channels in (("vace_frames", frame, VACE_FRAME_CHANNELS), ("vace_mask", mask, VACE_MASK_CHANNELS)):
            if tensor.ndim != 5 or tensor.shape[1] != channels or tensor.shape[0] not in (1, batch):
                raise ValueError(f"{name}[{index}] has shape {list(tensor.shape)}; expected [1 or {batch}, {channels}, "
                                 f"T, h, w] as ComfyUI's WanVaceToVideo makes it")
            if list(tensor.shape[2:]) != positions:
                raise ValueError(
                    f"{name}[{index}] covers latent frames x size {list(tensor.shape[2:])} but the latent is "
                    f"{positions}; use the latent made by the same VACE encode (its length, size and references)")
        if not math.isfinite(strength):
            raise ValueError(f"vace_strength[{index}] is {strength}; give a finite strength (1.0 is the default)")


IMAGE_CONCAT_CHANNELS = 20  # image-to-video: a 4-channel mask of the given frames and their 16-channel latents
# T2V/VACE; image-to-video (Wan 2.1 I2V / FLF2V, Wan 2.2 I2V A14B); Wan 2.2 TI2V 5B and Wan 2.1 Fun Control; Wan
# 2.2 Fun Control A14B (control latents, mask, start latents); Wan 2.1 Fun Camera (start latents, no mask)
MODEL_INPUT_CHANNELS = (LATENT_CHANNELS, LATENT_CHANNELS + IMAGE_CONCAT_CHANNELS, WAN22_LATENT_CHANNELS,
                        2 * LATENT_CHANNELS + IMAGE_CONCAT_CHANNELS, 2 * WAN22_LATENT_CHANNELS + 4,
                        3 * WAN22_LATENT_CHANNELS + 4,  # and Wan 2.2 Fun 5B (two or three 48-channel latents, a mask)
                        2 * LATENT_CHANNELS)
CLIP_VISION_WIDTH = 1280  # the CLIP vision (ViT-H/14) features Wan's image embedding takes


def check_model_input(latent) -> None:
    """A model call's input: the latent, with an image-to-video model's image channels concatenated (36), or a
    Wan 2.2 latent (48)."""
    if latent.ndim != 5 or latent.shape[1] not in MODEL_INPUT_CHANNELS or min(latent.shape) < 1:
        raise ValueError(f"the model input must be [B, C, T, h, w] with C 16, 32 or 36 (Wan 2.1 latents, with the "
                         f"image channels of Fun Camera or image-to-video), 48 (Wan 2.2 TI2V latents, Wan 2.1 Fun "
                         f"Control), 52 (Wan 2.2 Fun Control) or 100 / 148 (Wan 2.2 Fun 5B), got shape "
                         f"{list(latent.shape)}")


def check_noise_mask(noise_mask, latent_shape: tuple, sampler: str) -> None:
    """A LATENT's ``noise_mask`` (ComfyUI's: 0 where the latent is kept, 1 where it is sampled; e.g.
    Wan22ImageToVideoLatent's [B, 1, T, h, w] or SetLatentNoiseMask's [F, 1, H, W]), resized to the latent as
    ComfyUI resizes it. Only Wan 2.2 latents (TI2V 5B: per-frame timesteps) take one, with every sampler."""
    if noise_mask is None:
        return
    if latent_shape[1] != WAN22_LATENT_CHANNELS:
        raise ValueError(f"the latent carries a noise_mask but has {latent_shape[1]} channels: native inpainting "
                         f"masks are not supported for Wan 2.1 latents; only Wan 2.2 TI2V 5B latents "
                         f"({WAN22_LATENT_CHANNELS} channels) take one (remove SetLatentNoiseMask or the mask)")
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler {sampler!r} is unknown; valid samplers: {', '.join(SAMPLERS)}")
    if noise_mask.ndim not in (3, 4, 5) or min(noise_mask.shape) < 1:
        raise ValueError(f"the noise_mask has shape {list(noise_mask.shape)}; expected [F, H, W], [F, 1, H, W] or "
                         f"[B, C, T, h, w] (a MASK, SetLatentNoiseMask's or Wan22ImageToVideoLatent's)")


def check_clip_vision_tokens(tokens, batch: int) -> None:
    """CLIP vision tokens (ComfyUI's penultimate hidden states) for ``batch`` rows: [1 or batch, N, 1280]."""
    if tokens is None:
        return
    if tokens.ndim != 3 or tokens.shape[0] not in (1, batch) or tokens.shape[2] != CLIP_VISION_WIDTH:
        raise ValueError(f"CLIP vision tokens have shape {list(tokens.shape)}; expected [1 or {batch}, tokens, "
                         f"{CLIP_VISION_WIDTH}] (the penultimate hidden states of the CLIP vision ViT-H/14)")


def check_camera_conditions(camera, latent_shape: tuple) -> None:
    """A Fun Camera embedding (WanCameraEmbedding's) for a latent [B, C, T, h, w]: [1 or B, channels, T, 8h, 8w],
    one embedding per latent frame at the video's pixel size."""
    if camera is None:
        return
    batch, _, frames, height, width = latent_shape
    expected = [frames, height * VAE_SPATIAL_FACTOR, width * VAE_SPATIAL_FACTOR]
    if camera.ndim != 5 or camera.shape[0] not in (1, batch) or list(camera.shape[2:]) != expected:
        raise ValueError(f"camera_conditions has shape {list(camera.shape)}; expected [1 or {batch}, channels, "
                         f"{', '.join(map(str, expected))}]: the camera embedding of the video's length, height and "
                         "width (WanCameraEmbedding with the sampled video's size)")


def check_image_conditioning(image_latents, image_mask, latent_shape: tuple) -> None:
    """Image-to-video conditioning in ComfyUI's native format for a latent: the encoded video [rows, 16, T, h', w']
    at the latent's frame count (any size: it is resized to the latent's) and the mask of the given frames
    [rows, 1 or 4, T' <= T, h'', w''] (WanImageToVideo's or WanFirstLastFrameToVideo's)."""
    if image_latents is None:
        if image_mask is not None:
            raise ValueError("an image-to-video mask was given without the image latents it belongs to")
        return
    frames = latent_shape[2]
    if image_latents.ndim != 5 or image_latents.shape[1] < LATENT_CHANNELS or image_latents.shape[2] != frames:
        raise ValueError(f"the image-to-video latents have shape {list(image_latents.shape)}; expected [rows, "
                         f"{LATENT_CHANNELS}, {frames}, h, w]: the encoded video of as many frames as the sampled "
                         "latent (use the latent of the same image-to-video node)")
    if image_mask is not None and (image_mask.ndim != 5 or image_mask.shape[2] > frames):
        raise ValueError(f"the image-to-video mask has shape {list(image_mask.shape)}; expected [rows, 1 or 4, at "
                         f"most {frames} frames, h, w]")


def check_reference_latent(reference, rows: int, raw: bool) -> None:
    """A Wan 2.2 Fun reference latent for ``rows`` latent rows: as the conditioning holds it (``raw``: the encoded
    image [1 or rows, C, frames, h, w], Wan22FunControlToVideo's ``reference_latents``), or as a model call takes it
    ([rows, C, h, w]: ComfyUI's ``reference_latent`` model input, normalised, its first frame)."""
    if reference is None:
        return
    shape = list(reference.shape)
    if raw and (reference.ndim != 5 or shape[0] not in (1, rows)):
        raise ValueError(f"the reference latent has shape {shape}; expected [1 or {rows}, channels, frames, h, w] "
                         "(the encoded reference image, as Wan22FunControlToVideo makes it)")
    if not raw and (reference.ndim != 4 or shape[0] != rows):
        raise ValueError(f"the model call's reference latent has shape {shape}; expected [{rows}, channels, h, w]")


def check_time_latents(time_latents, latent_shape: tuple, which: str, noise_mask=None) -> None:
    """Latents concatenated after the sampled frames (ComfyUI's ``time_dim_concat``, WanPhantomSubjectToVideo's
    subject images): [1 or B rows, the latent's channels, any frames, the latent's height and width]; not with a
    noise mask (whose per-frame timesteps cover the sampled frames only)."""
    if time_latents is None:
        return
    batch, channels, _, height, width = latent_shape
    if (time_latents.ndim != 5 or time_latents.shape[0] not in (1, batch) or time_latents.shape[1] != channels
            or tuple(time_latents.shape[3:]) != (height, width)):
        raise ValueError(f"the {which} conditioning's time_dim_concat has shape {list(time_latents.shape)}; expected "
                         f"[1 or {batch}, {channels}, frames, {height}, {width}]: latents at the sampled latent's size "
                         "(WanPhantomSubjectToVideo at the latent's width and height)")
    if noise_mask is not None:
        raise ValueError("time_dim_concat (WanPhantomSubjectToVideo) cannot be sampled with a latent noise mask; "
                         "use the latent of the same node")


def check_model_forward(latent, timestep, context, vace_context, vace_strengths: list, clip_fea=None) -> None:
    """One model call from a sampler in the driver's process: the timestep (one per row, or one per row and latent
    frame: Wan 2.2's per-frame timesteps of a noise mask), context, CLIP vision and VACE rows match the latent's
    rows, and the VACE contexts its positions."""
    check_model_input(latent)
    batch, _, *positions = latent.shape
    check_clip_vision_tokens(clip_fea, batch)
    if list(timestep.shape) not in ([batch], [batch, positions[0]]):
        raise ValueError(f"the model call has {batch} latent rows of {positions[0]} frames but timesteps of shape "
                         f"{list(timestep.shape)}; give one timestep per row ([{batch}]) or per row and latent "
                         f"frame ([{batch}, {positions[0]}])")
    if context.ndim != 3 or context.shape[0] != batch:
        raise ValueError(f"the model call has {batch} latent rows but a text context of shape "
                         f"{list(context.shape)}; expected [{batch}, tokens, text width]")
    if vace_context is None:
        return
    expected = [batch, len(vace_strengths), VACE_FRAME_CHANNELS + VACE_MASK_CHANNELS, *positions]
    if list(vace_context.shape) != expected:
        raise ValueError(f"the VACE context has shape {list(vace_context.shape)}; expected {expected} (rows, "
                         "contexts, frames and mask channels, the latent's frames and size) as ComfyUI's VACE model "
                         "conditioning makes it")
    if not all(math.isfinite(strength) for strength in vace_strengths):
        raise ValueError(f"VACE strengths {vace_strengths} must be finite numbers (1.0 is the default)")


ANIMATE_FACE_SIZE = 512  # Wan 2.2 Animate's motion encoder reads square face frames of this size


def check_animate_inputs(pose_latents, face_pixels, latent_shape: tuple) -> None:
    """Wan 2.2 Animate's model inputs as WanAnimateToVideo makes them: pose latents [1 or B, 16, T', h, w] of the
    latent's size, a face video [1 or B, 3, F, 512, 512]; one line naming the input and the valid shape."""
    batch, _, _, h, w = latent_shape
    if pose_latents is not None and (pose_latents.ndim != 5 or pose_latents.shape[0] not in (1, batch)
                                     or pose_latents.shape[1] != LATENT_CHANNELS or pose_latents.shape[-2:] != (h, w)):
        raise ValueError(f"the pose video latents have shape {list(pose_latents.shape)}; expected [{batch}, "
                         f"{LATENT_CHANNELS}, frames, {h}, {w}] (the latent's size), as WanAnimateToVideo makes them")
    size = ANIMATE_FACE_SIZE
    if face_pixels is not None and (face_pixels.ndim != 5 or face_pixels.shape[0] not in (1, batch)
                                    or face_pixels.shape[1] != 3 or tuple(face_pixels.shape[-2:]) != (size, size)):
        raise ValueError(f"the face video has shape {list(face_pixels.shape)}; expected [{batch}, 3, frames, {size}, "
                         f"{size}] (RGB frames resized to {size}x{size}), as WanAnimateToVideo makes it")


def check_dtype_name(name: str) -> None:
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {name!r} is unknown; valid: {', '.join(DTYPE_NAMES)} (auto: bf16 on GPUs, fp32 on "
                         "the CPU)")


def check_weights_mode(mode: str) -> None:
    if mode not in WEIGHT_MODES:
        raise ValueError(f"weights {mode!r} is unknown; valid: {', '.join(WEIGHT_MODES)} (keep: quantized weights "
                         "stay quantized on every rank; dequantize: expanded to the compute dtype at load)")


# -- LoRAs -------------------------------------------------------------------------------------------------

LORA_STRENGTH_RANGE = (-100.0, 100.0)  # native LoraLoaderModelOnly's range


def check_lora_strength(strength: float) -> None:
    low, high = LORA_STRENGTH_RANGE
    if not (isinstance(strength, numbers.Real) and math.isfinite(strength) and low <= strength <= high):
        raise ValueError(f"LoRA strength {strength} is outside {low}..{high}")


def lora_strength_from_text(text: str, given: str) -> float:
    """The STRENGTH of a ``FILE:STRENGTH`` value (``given``, the command line's --lora), checked."""
    try:
        strength = float(text)
    except ValueError:
        low, high = LORA_STRENGTH_RANGE
        raise ValueError(f"LoRA strength {text!r} in {given!r} is not a number; valid: FILE or FILE:STRENGTH with a "
                         f"number from {low:g} to {high:g}, e.g. style.safetensors:0.8") from None
    check_lora_strength(strength)
    return strength


def check_model_loras(model_loras: dict) -> None:
    """The per-model LoRA lists of a sample request: (file, strength) pairs with strengths in range."""
    for handle, loras in model_loras.items():
        for entry in loras:
            if len(entry) != 2 or not isinstance(entry[0], str):
                raise ValueError(f"a LoRA of {handle!r} must be a (file, strength) pair, got {entry!r}")
            check_lora_strength(entry[1])


# -- causal streaming --------------------------------------------------------------------------------------


def check_stream_options(latent_frames: int, chunk: int, kv_window: int | None, sink: int, reanchor: bool = False,
                         use_cache: bool = True) -> None:
    """Chunked causal generation: a chunk of at least one latent frame, a KV window (latent frames attended,
    the current chunk included; None = the whole video) that holds a whole chunk next to the pinned sink frames;
    re-anchoring only with a rolling window, pinned frames and the KV cache."""
    if reanchor and (kv_window is None or not sink):
        raise ValueError(f"reanchor moves the pinned sink frames of a rolling window, but kv_window={kv_window} and "
                         f"sink={sink}; valid: a kv_window and a sink of 1 or more frames, or reanchor off")
    if reanchor and not use_cache:
        raise ValueError("reanchor turns the keys held in the KV cache; the uncached reference (use_cache off, "
                         "--no-kv-cache) has none: turn one of them off")
    if not _is_whole(latent_frames) or latent_frames < 1:
        raise ValueError(f"the latent must have at least 1 frame, got {latent_frames!r}")
    if not _is_whole(chunk) or chunk < 1:
        raise ValueError(f"chunk must be a whole number of latent frames >= 1, got {chunk!r} (1 = frame by frame, "
                         "3 = the usual chunk of causal checkpoints)")
    if not _is_whole(sink) or sink < 0:
        raise ValueError(f"sink must be a whole number of latent frames >= 0, got {sink!r} (0 = no pinned frames)")
    if kv_window is None:
        return
    if not _is_whole(kv_window) or kv_window < 1:
        raise ValueError(f"kv_window {kv_window!r} is not valid; valid: a whole number of latent frames >= the chunk "
                         f"({chunk}), or none for the whole video (0 in the node, the flag left out on the command line)")
    if kv_window < chunk:
        raise ValueError(f"kv_window={kv_window!r} latent frames is smaller than a chunk of {chunk}; the window must "
                         f"hold at least one whole chunk (>= {chunk}), or leave it empty for the whole video")
    if sink > kv_window:
        raise ValueError(f"sink={sink} is larger than kv_window={kv_window}; the pinned frames are part of the window "
                         f"(0 <= sink <= {kv_window - chunk})")
    if sink + chunk > kv_window:
        raise ValueError(f"sink={sink} plus a chunk of {chunk} exceed kv_window={kv_window}; the window must hold the "
                         f"pinned frames and a whole chunk (sink <= {kv_window - chunk} or kv_window >= {sink + chunk})")


def check_stream_start(start_frames: int, latent_frames: int, kv_window: int | None, sink: int) -> None:
    """Streaming from a start image: its latent frames come first, leave at least one frame to generate and fit the
    KV window beside the pinned sink frames."""
    if not _is_whole(start_frames) or start_frames < 0:
        raise ValueError(f"the start latent must have a whole number of frames >= 0, got {start_frames!r}")
    if start_frames >= latent_frames:
        raise ValueError(f"the start image takes {start_frames} latent frame(s) of {latent_frames}: nothing is left "
                         f"to generate; make the video longer (length >= 5 frames)")
    if kv_window is not None and start_frames > kv_window - sink:
        raise ValueError(f"the start image's {start_frames} latent frame(s) do not fit kv_window={kv_window} beside "
                         f"sink={sink}; use kv_window >= {start_frames + sink} or none")


def check_stream_start_latent(start_latent, latent_shape: tuple[int, ...], kv_window: int | None, sink: int) -> int:
    """A start image's raw latents against the streamed video's shape; returns their frame count."""
    batch, channels, frames, height, width = latent_shape
    shape = tuple(start_latent.shape)
    if len(shape) != 5 or shape[0] not in (1, batch) or shape[1] != channels or shape[3:] != (height, width):
        raise ValueError(f"the start latent must be [1 or {batch}, {channels}, n, {height}, {width}] (the start image "
                         f"encoded at the video's size), got {shape}")
    check_stream_start(shape[2], frames, kv_window, sink)
    return shape[2]


def stream_chunks(latent_frames: int, chunk: int, start_frames: int = 0) -> list[tuple[int, int]]:
    """(start frame, frame count) of each chunk; the last one may be shorter (8 frames in chunks of 3: 3+3+2).
    ``start_frames`` > 0 (streaming from a start image): those frames are the first block, the chunks follow
    (8 frames, 1 start frame, chunks of 3: 1+3+3+1)."""
    check_stream_options(latent_frames, chunk, None, 0)
    check_stream_start(start_frames, latent_frames, None, 0)
    first = [(0, start_frames)] if start_frames else []
    return first + [(start, min(chunk, latent_frames - start)) for start in range(start_frames, latent_frames, chunk)]


def check_prompt_switches(switch_chunks, latent_frames: int, chunk: int, start_frames: int = 0) -> None:
    """The chunks where a stream's prompt changes: whole chunk indices in increasing order, each a generated chunk
    after the first (chunk 0 takes the stream's own prompt; from a start image chunk 0 is the image's block)."""
    count = len(stream_chunks(latent_frames, chunk, start_frames))
    valid = f"valid: 1 to {count - 1}, increasing" if count > 1 else "this stream has one chunk, so none"
    previous = 0
    for index in switch_chunks:
        if not _is_whole(index) or not previous < index < count:
            raise ValueError(f"a prompt switch at chunk {index!r} is not valid for a stream of {count} chunks of "
                             f"{chunk} latent frames; {valid} (chunk 0 takes the stream's own prompt)")
        previous = index


def check_stream_layout(*, ring: int, cfg_parallel: bool) -> None:
    """Streaming splits a chunk's tokens over the Ulysses ranks (and heads over tp); ring attention with a KV
    cache and CFG parallel (one cache per branch lives on every rank) are refused."""
    if ring > 1:
        raise ValueError(f"streaming does not run with ring={ring}: ring attention with a KV cache is not supported; "
                         "use ulysses (and tp) for the sequence split, ring=1")
    if cfg_parallel:
        raise ValueError("streaming does not run with cfg_parallel: both guidance branches keep their own KV cache on "
                         "every rank and run one after the other; turn cfg_parallel off")


def check_stream_timesteps(timesteps) -> None:
    """A streaming timestep list (Self-Forcing's ``denoising_step_list``): at least one value, each in (0, 1000],
    strictly descending; None means the steps/shift schedule."""
    if timesteps is None:
        return
    values = [float(t) for t in timesteps]
    if not values or any(not 0.0 < t <= 1000.0 for t in values) or any(
            later >= earlier for earlier, later in zip(values, values[1:])):
        raise ValueError(f"timesteps must be a non-empty, strictly descending list of values in (0, 1000], "
                         f"e.g. 1000,750,500,250; got {values}")


def parse_stream_timesteps(text: str | None) -> list[float] | None:
    """'1000, 750,500' -> [1000.0, 750.0, 500.0] (checked); None or blank -> None (the steps/shift schedule)."""
    if text is None or not text.strip():
        return None
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"timesteps must be a comma list of numbers, e.g. 1000,750,500,250; got {text!r}") from None
    check_stream_timesteps(values)
    return values


# -- two experts and step ranges (Wan 2.2 A14B, chained samplers) ------------------------------------------

EXPERT_CONFIG_KEYS = ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
                      "freq_dim", "ffn_dim", "num_layers", "patch_size", "vace_layers")


def check_step_range(start_step: int, end_step: int | None, steps: int) -> None:
    """The steps one sampler runs out of ``steps`` (ComfyUI's start/end at step); None ends at the last step."""
    end = steps if end_step is None else end_step
    for name, value in (("start_step", start_step), ("end_step", end)):
        if not _is_whole(value):
            raise ValueError(f"{name} must be a whole number, got {value!r}")
    if not 0 <= start_step < end <= steps:
        raise ValueError(f"the step range start_step={start_step}, end_step={end} is not valid for {steps} steps; "
                         f"it needs 0 <= start_step < end_step <= {steps} (end_step None: to the last step)")


def check_experts(*, boundary: float, guidance_scale_low: float | None) -> None:
    """The two-expert settings: the switch point (a fraction of the 1000 training timesteps) and the low-noise
    expert's guidance scale (None: the high-noise expert's)."""
    if isinstance(boundary, bool) or not isinstance(boundary, numbers.Real) or not 0.0 <= boundary <= 1.0:
        raise ValueError(f"boundary must be a number in [0, 1] (a fraction of the 1000 training timesteps; Wan 2.2 "
                         f"T2V uses {T2V_EXPERT_BOUNDARY}, I2V {I2V_EXPERT_BOUNDARY}), got {boundary!r}")
    if guidance_scale_low is not None and (not math.isfinite(guidance_scale_low) or guidance_scale_low < 0):
        raise ValueError(f"the low-noise expert's guidance scale (cfg_low) must be a finite number >= 0 or unset, "
                         f"got {guidance_scale_low}")


def check_same_expert_config(high: dict, low: dict) -> None:
    """Both experts of a two-expert run must share one architecture (Wan 2.2 A14B's two halves do)."""
    differing = [f"{key} {high.get(key)!r} vs {low.get(key)!r}" for key in EXPERT_CONFIG_KEYS
                 if _comparable(high.get(key)) != _comparable(low.get(key))]
    if differing:
        raise ValueError(f"the high-noise and low-noise experts differ in {', '.join(differing)} (high vs low); "
                         "two experts must have the same size and kind (e.g. the two halves of Wan 2.2 A14B)")


def _comparable(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


# -- seeds, memory, ranks ----------------------------------------------------------------------------------

MAX_SEED = 2**64 - 1  # ComfyUI's seed widget range; torch generators take any unsigned 64-bit seed


def check_seed(seed: int) -> None:
    if not _is_whole(seed) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed {seed!r} is not valid; valid: an integer from 0 to {MAX_SEED} (2**64 - 1)")


def check_steps(steps: int) -> None:
    if not _is_whole(steps) or steps < 1:
        raise ValueError(f"steps must be an integer of at least 1, got {steps!r}")


def check_memory_budget(budget_gb: float) -> None:
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, numbers.Real) or not math.isfinite(budget_gb) \
            or budget_gb < 0:
        raise ValueError(f"memory_budget_gb must be a finite number of GB >= 0 (0: what the device can hold), "
                         f"got {budget_gb!r}")


def ranks_over_cores_warning(config: ParallelConfig, cpu_cores: int) -> str | None:
    """A warning (None when fine) for CPU ranks that outnumber the machine's cores: they would share cores and
    each rank's collectives wait on the slowest, so a run gets slower, not faster. Ray places its ranks on the
    cluster's machines (and checks the cluster's GPUs when it starts), so this machine's devices say nothing."""
    if config.backend != "local":
        return None
    cpu_ranks = sum(1 for device in config.rank_devices() if device == "cpu")
    if cpu_ranks > cpu_cores:
        return (f"world={config.world} puts {cpu_ranks} ranks on the CPU but this machine has {cpu_cores} cores; "
                f"ranks will share cores (use world <= {cpu_cores} on CPU)")
    return None
