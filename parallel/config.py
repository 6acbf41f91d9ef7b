"""ParallelConfig: how many ranks the worker pool has and how they split the work.

The rank layout is ``world = dp x cfg x ulysses x ring x tp`` with ``tp`` varying fastest, so tensor-parallel
peers are neighbours (and share a machine on a cluster). ``cfg`` is 2 with CFG parallel (conditional and
unconditional passes on two halves of the pool) and ``dp`` (data-parallel replicas that split the batch) fills
whatever the other degrees leave; with a batch of one the extra replicas still share the VAE patch work.

Everything here is checked up front, before a process starts, with messages that name the numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

BACKENDS = ("local", "ray")
MESH_DIMS = ("dp", "cfg", "ulysses", "ring", "tp")  # outermost first; tp varies fastest


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", _as_device_tuple(self.devices))
        self._check_degrees()
        self._check_devices_spec()
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is unknown; valid backends: {', '.join(BACKENDS)}")

    # -- derived degrees ----------------------------------------------------------------------------------

    @property
    def cfg(self) -> int:
        return 2 if self.cfg_parallel else 1

    @property
    def model_parallel(self) -> int:
        """Ranks that cooperate on one denoising pass: cfg x ulysses x ring x tp."""
        return self.cfg * self.ulysses * self.ring * self.tp

    @property
    def dp(self) -> int:
        return self.world // self.model_parallel

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes along ``MESH_DIMS``."""
        return (self.dp, self.cfg, self.ulysses, self.ring, self.tp)

    # -- checks -------------------------------------------------------------------------------------------

    def _check_degrees(self) -> None:
        for name in ("world", "tp", "ulysses", "ring", "vae_patch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        product = self.model_parallel
        if self.world % product:
            factors = f"cfg x ulysses x ring x tp = {self.cfg} x {self.ulysses} x {self.ring} x {self.tp} = {product}"
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
        split = self.tp * self.ulysses
        if num_heads % split:
            divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
            raise ValueError(
                f"the model has {num_heads} attention heads, which do not divide over tp x ulysses = "
                f"{self.tp} x {self.ulysses} = {split} ranks; tp x ulysses must divide {num_heads} "
                f"(one of {', '.join(map(str, divisors))})"
            )

    def rank_devices(self, cuda_count: int | None = None) -> list[str]:
        """The device of each rank on this machine (local backend). ``cuda_count``: visible GPUs (default: ask torch)."""
        spec = self.devices
        if cuda_count is None and any(d != "cpu" for d in spec):
            import torch

            cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
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
            raise ValueError(f"devices {', '.join(missing)} do not exist: {cuda_count} GPUs are visible (cuda:0..)")
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

