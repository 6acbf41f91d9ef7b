"""The `auto` layout: which tp / ulysses / ring / cfg_parallel / vae_patch degrees (data parallelism fills the rest)
to run a job with, chosen by a cost model calibrated on this machine; runs in the driver (CLI or ComfyUI).

The cost of one denoising step on one rank is its share of the transformer's matmul and attention work, timed
at the speeds the calibration measured with as many ranks busy at once as the layout keeps busy
(``calibration.py``), plus the time of the collectives its layout adds, each priced as ``latency + bytes /
bandwidth`` with the latency and bandwidth measured for that collective within groups of the layout's size
(a tp 2 all-reduce in 4 ranks runs in pairs) on this machine's links:

* tensor parallelism: per block three all-reduces of the block's activations and four small ones (q/k norm
  statistics; the same count ``distributed/tensor_parallel.analytic_collectives`` gives);
* Ulysses: per block two all-to-alls (q, k and v stacked in one, the attention output back);
* ring attention: per block ``ring - 1`` exchanges of the stacked key/value block with the neighbours, hidden
  behind the attention compute as far as the device overlaps them (NCCL streams do, gloo's CPU threads barely do);
* CFG parallel: one exchange of the guidance prediction per step;
* data parallel: nothing (with a batch of one the extra replicas wait, and share the VAE tiles).

On a pool whose ranks sit on several hosts (``Machine.rank_hosts``, a Ray pool placed by host) the probe also
measures a pair of ranks inside a host and a pair across hosts (``Machine.host_links``); a group whose ranks span
hosts (``crossing_groups``: the mesh is tp fastest, then ring, Ulysses, CFG, so tp groups are the first to stay
inside a host) pays the link across hosts, its latency and bandwidth taken as the worse of the group's own
measured price and the cross-host pair's (a ring collective runs at its slowest hop). So a layout that keeps the
chatty groups inside a host ranks first, and the table names the groups that cross hosts. On one host nothing of
this applies: the prices are those of before.

Memory per rank is the transformer file's bytes over tp (quantized files stay quantized) plus the activations
of the rank's sequence share; layouts that do not fit the free memory (or ``memory_budget_gb``) are left out,
and when none fits the error names the bytes needed per rank against those free. The VAE's tiles are shared by
every rank when a frame holds more than one tile (``vae_patch``), and not tiled otherwise (tiling is then no
faster and would change the numbers). Manual layouts are never changed: ``auto`` is a choice of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from .config import (CLIP_VISION_TOKENS, LATENT_CHANNELS, TEXT_TOKENS, TEMPORAL_STRIDE, ParallelConfig,
                     check_head_split, latent_spatial_factor)

DEFAULT_VAE_TILE_PX = 256  # the tile edge the VAE uses when vae_patch > 1 and no tile size is given
ACTIVATION_COPIES = 6  # live [tokens, dim] tensors of one block's forward (one pass at a time), temporaries included


@dataclass(frozen=True)
class ModelCost:
    """What the cost model needs of a transformer, read from its file header."""

    layers: int
    heads: int
    head_dim: int
    ffn_dim: int
    weight_bytes: int  # as stored (fp8 and GGUF files stay quantized)
    patch: tuple[int, int, int] = (1, 2, 2)
    text_tokens: int = TEXT_TOKENS  # every token the cross-attention reads: the text's and CLIP vision's (I2V)
    latent_channels: int = LATENT_CHANNELS  # 48 for Wan 2.2 TI2V 5B, whose VAE compresses 16x

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelCost":
        from .validation import TRANSFORMER_KINDS, inspect_model_file, transformer_config
        from .worker.memory import estimated_load_bytes

        info = inspect_model_file(path, "--model", TRANSFORMER_KINDS)
        config = transformer_config(info)
        if config is None:
            raise ValueError(f"{path}: no header or config.json tells the transformer's shape; use layout manual")
        return cls.from_config(config, estimated_load_bytes((str(path),)))

    @classmethod
    def from_config(cls, config: dict, weight_bytes: int) -> "ModelCost":
        """The cost of a transformer of this diffusers ``config`` whose weights take ``weight_bytes``."""
        return cls(layers=int(config["num_layers"]), heads=int(config["num_attention_heads"]),
                   head_dim=int(config["attention_head_dim"]), ffn_dim=int(config["ffn_dim"]),
                   weight_bytes=weight_bytes, patch=tuple(config.get("patch_size", (1, 2, 2))),
                   text_tokens=TEXT_TOKENS + image_tokens(config),
                   latent_channels=int(config.get("out_channels", LATENT_CHANNELS)))

    @property
    def vae_factor(self) -> int:
        """Pixels per latent along each spatial axis: 8 (Wan 2.1 VAE), 16 (the Wan 2.2 VAE of 48-channel models)."""
        return latent_spatial_factor(self.latent_channels)


def image_tokens(config) -> int:
    """CLIP vision tokens the image cross-attention reads: 257 per image for Wan 2.1 I2V, Fun InP and Fun Control
    (one) and FLF2V (two)."""
    from .weights.detect import image_inputs

    if not config.get("image_dim"):
        return 0
    return 2 * CLIP_VISION_TOKENS if image_inputs(config) == "first_last" else CLIP_VISION_TOKENS


@dataclass(frozen=True)
class Job:
    """One sampling run: the video, the steps and whether guidance runs a second (unconditional) pass."""

    width: int
    height: int
    frames: int
    steps: int = 30
    batch: int = 1
    guidance: bool = True

    @classmethod
    def of_latent(cls, shape, *, steps: int, batch: int, guidance: bool) -> "Job":
        """The job whose video a latent of ``shape`` ([rows, channels, frames, height, width]) holds: the spatial
        factor follows the channels (16 for the Wan 2.2 VAE's 48)."""
        channels, frames, height, width = shape[1:]
        factor = latent_spatial_factor(channels)
        return cls(width * factor, height * factor, (frames - 1) * TEMPORAL_STRIDE + 1, steps=steps, batch=batch,
                   guidance=guidance)

    def latent_frames(self) -> int:
        return (self.frames - 1) // TEMPORAL_STRIDE + 1

    def video_tokens(self, model: ModelCost) -> int:
        rows = math.ceil(self.height / model.vae_factor / model.patch[1])
        columns = math.ceil(self.width / model.vae_factor / model.patch[2])
        return math.ceil(self.latent_frames() / model.patch[0]) * rows * columns

    def latent_elements(self, model: ModelCost) -> int:
        area = (self.height // model.vae_factor) * (self.width // model.vae_factor)
        return self.batch * model.latent_channels * self.latent_frames() * area


@dataclass(frozen=True)
class Link:
    """One collective's price on this machine's links: seconds per call plus bytes per second moved."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, calls: float, moved_bytes: float) -> float:
        return calls * self.latency_s + moved_bytes / self.bytes_per_s


@dataclass(frozen=True)
class Machine:
    """The calibration's figures for one device set (``calibration.py``): per-rank speeds with every rank busy
    (and with fewer busy), collective prices (the whole world's, and within groups of each size), the share of ring
    traffic the device hides behind compute, free bytes per rank."""

    matmul_flops: float
    attention_flops: float
    all_reduce: Link
    all_to_all: Link
    send_recv: Link
    free_bytes: int
    element_bytes: int = 4  # the compute dtype's: fp32 on CPU ranks, bf16 on GPUs
    overlap: float = 0.0
    matmul_flops_alone: float | None = None  # a rank's speed while the others wait (None: as when all are busy)
    matmul_flops_by_active: tuple[tuple[int, float], ...] = ()  # (busy ranks, a rank's speed) as measured
    group_links: tuple[tuple[int, str, Link], ...] = ()  # (group size, kind, price) within groups of that size
    group_links_alone: tuple[tuple[int, str, Link], ...] = ()  # the same within one group while the others wait
    busy_latency_s: float = 0.0  # what a collective call of the whole world costs when every rank computes
    busy_latencies: tuple[tuple[int, float], ...] = ()  # (group size, the same within groups of that size)
    cpu_cores: int = 0  # the cores CPU ranks share (0: every rank has a device of its own)
    rank_threads: int = 1  # the threads each CPU rank computes with
    rank_hosts: tuple[int, ...] = ()  # each rank's host (an index), in rank order; () or all equal: one host
    host_links: tuple[tuple[str, str, Link], ...] = ()  # ("inside" / "across", kind, price) of a pair of ranks

    @property
    def hosts(self) -> int:
        return len(set(self.rank_hosts)) or 1

    def across_hosts(self, kind: str, link: Link) -> Link:
        """``link`` for a group whose ranks span hosts: the worse latency and bandwidth of it and of the pair of
        ranks measured across hosts (unchanged when no such pair was measured)."""
        across = {name: measured for where, name, measured in self.host_links if where == "across"}.get(kind)
        if across is None:
            return link
        return Link(max(link.latency_s, across.latency_s), min(link.bytes_per_s, across.bytes_per_s))

    def link(self, kind: str, size: int, *, every_rank_busy: bool = False, alone: bool = False,
             crosses_hosts: bool = False) -> Link:
        """The price of collective ``kind`` within groups of ``size`` ranks (every group at once, or one group
        ``alone`` while the others wait), as measured when the calibration has that size, else the whole world's;
        for groups whose ranks span hosts, no better than the link across hosts (``across_hosts``).
        With every rank computing between calls a call costs at least the busy latency measured within groups of
        that size: ranks that share cores wait for their partners' turn on one."""
        measured = {(group_size, name): link for group_size, name, link in self.group_links}
        if alone:
            measured.update({(group_size, name): link for group_size, name, link in self.group_links_alone})
        link = measured.get((size, kind), getattr(self, kind))
        if crosses_hosts:
            link = self.across_hosts(kind, link)
        busy = dict(self.busy_latencies).get(size, self.busy_latency_s)
        if every_rank_busy and busy > link.latency_s:
            return Link(busy, link.bytes_per_s)
        return link

    def speed_up(self, world: int, active: int) -> float:
        """How much faster ``active`` busy ranks of ``world`` compute than when all are busy: ranks that share
        cores (CPU ranks outnumbering them) get the idle ranks' share. As measured with that many ranks busy when
        the calibration has it (``speeds_by_active``), else up to a rank's speed alone; never more than the cores
        allow (``core_share_gain``); one device per rank gains nothing."""
        measured = self.speeds_by_active()
        if active in measured:
            gain = measured[active] / measured.get(world, self.matmul_flops)
        else:
            gain = min((self.matmul_flops_alone or self.matmul_flops) / self.matmul_flops, world / max(active, 1))
        return max(1.0, min(gain, self.core_share_gain(world, active)))

    def speeds_by_active(self) -> dict[int, float]:
        """A rank's measured speed per number of busy ranks, each raised to what the reading with more ranks busy
        implies: fewer busy ranks never compute slower per rank, and CPU ranks whose threads outnumber the cores
        get at most their share of them (``core_share``), so their total speed never beats fewer ranks'. A
        disturbance only ever slows a reading, so where two readings disagree the faster one counts (four ranks on
        two cores once read 41 GFLOP/s each against 78 for two busy ranks: more work done than the cores can)."""
        speeds = dict(self.matmul_flops_by_active)
        most_busy_first = sorted(speeds, reverse=True)
        for busier, active in zip(most_busy_first, most_busy_first[1:]):
            implied = speeds[busier] * self.core_share(active) / self.core_share(busier)
            speeds[active] = max(speeds[active], implied)
        return speeds

    def ranks_share_cores(self, busy: int) -> bool:
        """Whether ``busy`` CPU ranks' threads outnumber the cores (never for ranks on devices of their own)."""
        return self.core_share(busy) < 1.0

    def core_share_gain(self, world: int, active: int) -> float:
        """How many more cores each of ``active`` busy CPU ranks can use than when all ``world`` are busy: none
        while the busy ranks' threads do not outnumber the cores. A probe that measures more (a short turbo, a
        neighbour's load on a shared machine) measured noise; ranks on devices of their own are not bounded."""
        if not self.cpu_cores:
            return math.inf
        return self.core_share(active) / self.core_share(world)

    def core_share(self, busy: int) -> float:
        """The share of a core each thread of ``busy`` CPU ranks gets (1 on ranks with devices of their own)."""
        if not self.cpu_cores:
            return 1.0
        return min(1.0, self.cpu_cores / (busy * self.rank_threads))


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    cfg_parallel: bool = False
    vae_patch: int = 1

    def name(self) -> str:
        parts = [f"{field} {value}" for field, value in (("tp", self.tp), ("ulysses", self.ulysses),
                                                          ("ring", self.ring)) if value > 1]
        parts += ["cfg_parallel"] if self.cfg_parallel else []
        parts += [f"vae_patch {self.vae_patch}"] if self.vae_patch > 1 else []
        return ", ".join(parts) or "one rank per job (data parallel)"

    def applied_to(self, config: ParallelConfig) -> ParallelConfig:
        """``config`` (world, devices, backend, timeouts, budget) with this layout's degrees."""
        return replace(config, tp=self.tp, ulysses=self.ulysses, ring=self.ring, cfg_parallel=self.cfg_parallel,
                       vae_patch=self.vae_patch)


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    step_s: float
    compute_s: float
    communication_s: float
    memory_bytes: int
    fits: bool
    cross_host: tuple[str, ...] | None = None  # the layout's groups whose ranks span hosts; None on one host



def degrees_set(tp: int, ulysses: int, ring: int, vae_patch: int, cfg_parallel: bool) -> list[str]:
    """The degrees set away from their single-device values: with ``auto`` they are a mistake (it picks them)."""
    given = [f"{name}={value}" for name, value in (("tp", tp), ("ulysses", ulysses), ("ring", ring),
                                                    ("vae_patch", vae_patch)) if value != 1]
    return given + ["cfg_parallel"] * bool(cfg_parallel)


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


GROUP_DIMS = ("cfg", "ulysses", "ring", "tp")  # the mesh's dimensions inside dp, outermost first (config.MESH_DIMS)


def group_ranks(layout: Layout, world: int, dim: str) -> list[list[int]]:
    """The ranks of each group along mesh dimension ``dim`` (row-major over dp, cfg, ulysses, ring, tp; tp
    varies fastest, as ``config.rank_coordinates``)."""
    sizes = {"cfg": 2 if layout.cfg_parallel else 1, "ulysses": layout.ulysses, "ring": layout.ring, "tp": layout.tp}
    size = sizes[dim]
    stride = math.prod(sizes[inner] for inner in GROUP_DIMS[GROUP_DIMS.index(dim) + 1:])
    firsts = [rank for rank in range(world) if rank // stride % size == 0]
    return [[first + k * stride for k in range(size)] for first in firsts]


def crossing_groups(layout: Layout, world: int, rank_hosts: tuple[int, ...]) -> tuple[str, ...]:
    """The layout's group kinds (tp, ring, ulysses, cfg) with a group whose ranks sit on more than one host."""
    if len(set(rank_hosts)) < 2:
        return ()
    return tuple(dim for dim in reversed(GROUP_DIMS)
                 if any(len({rank_hosts[rank] for rank in ranks}) > 1 for ranks in group_ranks(layout, world, dim)))


def vae_patch_for(job: Job, world: int) -> int:
    """Every rank shares the VAE tiles when a frame holds more than one default tile; else whole frames."""
    return world if world > 1 and max(job.width, job.height) > DEFAULT_VAE_TILE_PX else 1


def candidate_layouts(world: int, model: ModelCost, job: Job, *, streaming: bool = False) -> list[Layout]:
    """Every layout of ``world`` ranks this model can run: tp and tp x ulysses dividing the heads (tp also the
    FFN width), CFG parallel only with guidance, no ring or CFG parallel when streaming."""
    layouts = []
    vae_patch = 1 if streaming else vae_patch_for(job, world)
    for tp in _divisors(world):
        for ulysses in _divisors(world // tp):
            try:
                check_head_split(model.heads, tp=tp, ulysses=ulysses, ffn_dim=model.ffn_dim)
            except ValueError:
                continue
            for ring in _divisors(world // (tp * ulysses)) if not streaming else [1]:
                left = world // (tp * ulysses * ring)
                for cfg in (False, True) if job.guidance and left % 2 == 0 and not streaming else (False,):
                    layouts.append(Layout(tp, ulysses, ring, cfg, vae_patch))
    return layouts


def block_flops(model: ModelCost, tokens: int, sequence_split: int = 1) -> tuple[float, float]:
    """(matmul, attention) FLOPs of one block's forward on one rank holding ``tokens / sequence_split`` of a
    video's ``tokens`` (one pass, no tensor parallelism): the q/k/v/out projections of self-attention, the
    cross-attention's q/out and its text keys/values, the FFN; self-attention's scores and weighted sum over the
    whole sequence and the cross-attention's over the text."""
    local, text, dim = math.ceil(tokens / sequence_split), model.text_tokens, model.dim
    linear = 2 * local * (6 * dim * dim + 2 * dim * model.ffn_dim) + 2 * text * 2 * dim * dim
    attention = 4 * tokens * tokens * dim / sequence_split + 4 * local * text * dim
    return linear, attention


def activation_bytes(rows: int, local_tokens: int, dim: int, element_bytes: int) -> int:
    """Activation bytes a rank holds during one block's forward (``ACTIVATION_COPIES`` live [tokens, dim])."""
    return rows * local_tokens * dim * element_bytes * ACTIVATION_COPIES


def data_parallel(layout: Layout, world: int) -> int:
    """The replicas of ``layout`` in ``world`` ranks: what tp, the sequence split and CFG parallel leave."""
    return world // (layout.tp * layout.ulysses * layout.ring * (2 if layout.cfg_parallel else 1))


def memory_parts(layout: Layout, world: int, model: ModelCost, job: Job, element_bytes: int) -> dict[str, int]:
    """The bytes one rank holds, per part: its share of the weights (over tp; quantized files stay quantized) and
    the activations of its sequence share (``activation_bytes``; attention runs blockwise, its q, k, v and output
    among those copies)."""
    local = math.ceil(job.video_tokens(model) / (layout.ulysses * layout.ring))
    rows = math.ceil(job.batch / data_parallel(layout, world))
    return {"weights": model.weight_bytes // layout.tp,
            "activations": activation_bytes(rows, local, model.dim, element_bytes)}


def predict(layout: Layout, world: int, model: ModelCost, job: Job, machine: Machine) -> Prediction:
    """Seconds of one denoising step on the slowest rank, and the bytes each rank holds (``memory_parts``)."""
    sequence_split = layout.ulysses * layout.ring
    dp = data_parallel(layout, world)
    passes = math.ceil(job.batch / dp) * (2 if job.guidance and not layout.cfg_parallel else 1)
    tokens, text, dim = job.video_tokens(model), model.text_tokens, model.dim
    local = math.ceil(tokens / sequence_split)
    crossing = crossing_groups(layout, world, machine.rank_hosts) if machine.hosts > 1 else None
    linear, attention = block_flops(model, tokens, sequence_split)
    active = world // dp * min(dp, job.batch)  # replicas without a batch row wait
    speed_up = machine.speed_up(world, active)
    compute_block = linear / layout.tp / machine.matmul_flops / speed_up
    attention_block = attention / layout.tp / machine.attention_flops / speed_up
    communication = _block_communication(layout, local, text, dim, machine, attention_block, active, world,
                                         crossing or ())
    step_compute = passes * model.layers * (compute_block + attention_block)
    step_communication = (passes * model.layers * communication
                          + _guidance_exchange(layout, model, job, machine, active, world, crossing or ()))
    memory = sum(memory_parts(layout, world, model, job, machine.element_bytes).values())
    return Prediction(layout, step_compute + step_communication, step_compute, step_communication, memory,
                      memory <= machine.free_bytes, crossing)


TP_ALL_REDUCES_PER_BLOCK = 7  # three of the activations, four of the q/k norm statistics


def block_calls(layout: Layout) -> dict[str, int]:
    """Collective calls one rank makes per transformer block's forward, per kind, as ``CollectiveCounter`` counts
    them (the tests check both against the counted calls): a ring exchange is one send and one receive at once."""
    return {"all_reduce": TP_ALL_REDUCES_PER_BLOCK if layout.tp > 1 else 0,
            "all_to_all": 2 if layout.ulysses > 1 else 0,
            "send_recv": layout.ring - 1}


def block_bytes(layout: Layout, local: int, text: int, dim: int, element: int) -> dict[str, float]:
    """Bytes one rank sends per transformer block's forward, per collective kind (CollectiveCounter's convention:
    a ring all-reduce sends 2 (n - 1) / n of the tensor; tensor parallelism as ``analytic_collectives``)."""
    moved = {"all_reduce": 0.0, "all_to_all": 0.0, "send_recv": 0.0}
    if layout.tp > 1:
        share = 2 * (layout.tp - 1) / layout.tp
        moved["all_reduce"] = share * (3 * local * dim * element + (3 * local + text) * 4)
    if layout.ulysses > 1:
        moved["all_to_all"] = 4 * (layout.ulysses - 1) / layout.ulysses * local * dim / layout.tp * element
    if layout.ring > 1:  # with Ulysses around it (USP) a rank holds ulysses x local tokens of 1 / ulysses of the heads
        moved["send_recv"] = (layout.ring - 1) * 2 * local * dim / layout.tp * element
    return moved


def _block_communication(layout: Layout, local: int, text: int, dim: int, machine: Machine,
                         attention_s: float, active: int, world: int, crossing: tuple[str, ...] = ()) -> float:
    """Seconds one rank spends in the collectives of one transformer block's forward, with ``active`` of the
    ``world`` ranks computing (``_link``); the groups named in ``crossing`` span hosts."""
    moved, calls = block_bytes(layout, local, text, dim, machine.element_bytes), block_calls(layout)
    seconds = {kind: _link(machine, kind, size, active, world, group in crossing).seconds(calls[kind], moved[kind])
               for kind, size, group in (("all_reduce", layout.tp, "tp"), ("all_to_all", layout.ulysses, "ulysses"),
                                         ("send_recv", layout.ring, "ring")) if size > 1}
    ring = seconds.pop("send_recv", 0.0)
    return sum(seconds.values()) + max(ring - machine.overlap * attention_s, (1 - machine.overlap) * ring)


def _guidance_exchange(layout: Layout, model: ModelCost, job: Job, machine: Machine, active: int,
                       world: int, crossing: tuple[str, ...] = ()) -> float:
    """CFG parallel: the two halves swap their predictions once per step (float32 latents of the batch)."""
    if not layout.cfg_parallel:
        return 0.0
    link = _link(machine, "all_reduce", 2, active, world, "cfg" in crossing)
    return link.seconds(1, 4 * job.latent_elements(model))


def _link(machine: Machine, kind: str, size: int, active: int, world: int, crosses_hosts: bool = False) -> Link:
    """A collective's price within groups of ``size`` while ``active`` of the ``world`` ranks compute: every rank
    busy, or (replicas without a batch row waiting) the one group of the active ranks alone."""
    return machine.link(kind, size, every_rank_busy=active == world, alone=active == size,
                        crosses_hosts=crosses_hosts)


def rank_layouts(world: int, model: ModelCost, job: Job, machine: Machine, *,
                 streaming: bool = False) -> list[Prediction]:
    """Every candidate's prediction, fastest first (those that fit before those that do not)."""
    predictions = [predict(layout, world, model, job, machine)
                   for layout in candidate_layouts(world, model, job, streaming=streaming)]
    return sorted(predictions, key=lambda p: (not p.fits, p.step_s, len(p.cross_host or ()), p.layout.tp,
                                              p.layout.ring))


def choose(world: int, model: ModelCost, job: Job, machine: Machine, *, streaming: bool = False) -> list[Prediction]:
    """The ranked predictions, the chosen (first) one fitting; a one-line ValueError when none fits."""
    ranked = rank_layouts(world, model, job, machine, streaming=streaming)
    if not ranked:
        raise ValueError(f"no layout of {world} ranks splits this model's {model.heads} heads; use a world whose "
                         f"divisors divide {model.heads}")
    if not ranked[0].fits:
        least = min(ranked, key=lambda p: p.memory_bytes)
        raise ValueError(f"no layout of {world} ranks fits: the smallest ({least.layout.name()}) needs "
                         f"{least.memory_bytes / 2**30:.2f} GiB per rank, {machine.free_bytes / 2**30:.2f} GiB "
                         "are free; add ranks (tensor parallelism splits the weights) or use a quantized file")
    return ranked


def explain(ranked: list[Prediction], job: Job, shown: int = 3) -> str:
    """The chosen layout and the next ones as a small table, for the log; on several hosts a last column names
    the groups that cross hosts ("none" when every group stays inside one)."""
    several = any(prediction.cross_host is not None for prediction in ranked)
    lines = [f"auto layout ({job.width}x{job.height}, {job.frames} frames, {job.steps} steps):",
             f"  {'layout':<40} {'s/step':>8} {'compute':>8} {'comm':>8} {'GiB/rank':>9}"
             + (f"  {CROSS_HOST_COLUMN}" if several else "")]
    for index, prediction in enumerate(ranked[:shown]):
        mark = "*" if index == 0 else " "
        crossing = f"  {', '.join(prediction.cross_host or ()) or 'none'}" if several else ""
        lines.append(f"{mark} {prediction.layout.name():<40} {prediction.step_s:>8.3f} {prediction.compute_s:>8.3f} "
                     f"{prediction.communication_s:>8.3f} {prediction.memory_bytes / 2**30:>9.3f}{crossing}")
    return "\n".join(lines)


CROSS_HOST_COLUMN = "across hosts"
