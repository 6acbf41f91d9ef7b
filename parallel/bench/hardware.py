"""`wanmesh bench plan --hardware NAME` (or ``--hardware-file spec.toml``): every layout of a job priced on a GPU
cluster that is not here, from the GPUs' published figures; runs in the CLI process and starts no rank.

A named spec (``HARDWARE``) or a TOML file with the same fields (``Hardware``) becomes a ``Machine`` of the auto
layout's cost model (``machine``): a rank's matmul and attention speeds are the datasheet's dense bf16 peak times
an achievable fraction, the collectives' price inside a node is the GPU's link (NVLink, PCIe with or without
peer-to-peer) and across nodes the network's, and a GPU's free memory is its memory less a worker's own. The
same functions ``auto`` uses (``auto_layout.choose`` / ``predict`` / ``memory_parts``) then price every layout
of ``--gpus-per-node x --nodes`` GPUs, and auto's choice at every GPU count dividing that, against one GPU and
against the physical floor (the step's FLOPs at the dense peak of every GPU). The model is a released one by
name (``releases.RELEASES``, its bf16 weights' bytes from the released shapes) or a transformer file (its header
only). The HBM bandwidth is listed for the reader; the cost model prices compute and collectives, not memory
traffic (a Wan block's matmuls and attention at video lengths are compute bound). Everything printed is a
prediction from datasheet figures, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

from ..auto_layout import (CROSS_HOST_COLUMN, Job, Link, Machine, ModelCost, Prediction, block_flops, choose,
                           memory_parts, rank_layouts)
from ..calibration import GPU_RING_OVERLAP, LINK_KINDS
from .releases import RELEASES

# The figures below are datasheet peaks. What kernels reach is a fraction of them, one documented constant each,
# applied to every GPU alike:
MATMUL_FRACTION = 0.6  # large bf16 GEMMs (a block's projections and FFN): cuBLAS reaches 60-75% of the dense peak
ATTENTION_FRACTION = 0.4  # FlashAttention-2 forward at head dim 128 (PyTorch's SDPA): about 35-50% of the peak
LINK_FRACTION = 0.8  # NCCL's bus bandwidth on large messages: about 80% of a link's bandwidth per direction
NO_P2P_FACTOR = 0.5  # without peer-to-peer, NCCL copies through host memory: each byte crosses PCIe twice
BF16_BYTES = 2
NOTE = "a prediction from datasheet figures, not a measurement"


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU kind and its cluster: the datasheet's figures (peak dense bf16, memory, links) and the network's
    between nodes (a typical deployment's, not the GPU's datasheet)."""

    name: str
    bf16_tflops: float  # dense (without 2:4 sparsity)
    memory_gib: float
    memory_gb_s: float
    nvlink_gb_s: float  # both directions together, as datasheets give it; 0: no NVLink
    pcie_gen: int
    pcie_gb_s: float  # x16, per direction
    p2p: bool  # whether the GPUs of a node exchange directly (NVLink or PCIe peer-to-peer)
    link_latency_us: float  # one collective call inside a node
    network_gb_s: float  # across nodes, per GPU and direction
    network_latency_us: float

    def inside_link(self) -> Link:
        """A collective's price inside a node: NVLink's bandwidth per direction, else PCIe's (halved without
        peer-to-peer), at ``LINK_FRACTION``."""
        per_direction = self.nvlink_gb_s / 2 if self.nvlink_gb_s else self.pcie_gb_s
        factor = LINK_FRACTION * (1.0 if self.p2p else NO_P2P_FACTOR)
        return Link(self.link_latency_us * 1e-6, per_direction * factor * 1e9)

    def network_link(self) -> Link:
        return Link(self.network_latency_us * 1e-6, self.network_gb_s * LINK_FRACTION * 1e9)

    def link_text(self) -> str:
        if self.nvlink_gb_s:
            return f"NVLink {self.nvlink_gb_s:g} GB/s"
        return f"PCIe Gen{self.pcie_gen} {self.pcie_gb_s:g} GB/s per direction, {'' if self.p2p else 'no '}P2P"


# Vendors' datasheets (SXM parts for H100, H200 and A100; the RTX 4090's 165 TFLOP/s is dense, 330 with
# sparsity); their memory "GB" is taken as GiB (an 80 GB H100 reports about 79.6 GiB). The network is a typical
# cluster's: one 400 Gb/s InfiniBand NIC per GPU on HGX H100/H200, one 200 Gb/s per GPU on HGX A100, one 400 Gb/s
# Ethernet NIC per four L40S, one 100 Gb/s Ethernet port per eight RTX 4090 (TCP, no RDMA). The latencies are
# typical NCCL small-message figures for those links.
HARDWARE = {
    "h100-sxm": Hardware("H100 SXM", 989, 80, 3350, 900, 5, 64, True, 10, 50, 20),
    "h200": Hardware("H200", 989, 141, 4800, 900, 5, 64, True, 10, 50, 20),
    "a100-80g": Hardware("A100 80G", 312, 80, 2039, 600, 4, 32, True, 10, 25, 20),
    "l40s": Hardware("L40S", 362, 48, 864, 0, 4, 32, True, 20, 12.5, 30),
    "rtx-4090": Hardware("RTX 4090", 165, 24, 1008, 0, 4, 32, False, 30, 1.5, 60),
}
FIELDS = {field.name: field.type for field in dataclasses.fields(Hardware)}
MAY_BE_ZERO = {"nvlink_gb_s", "link_latency_us", "network_latency_us"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """bench plan's flags for a cluster that is not here (the rest of its flags give the model and the job)."""
    parser.add_argument("--hardware", metavar="NAME", help=f"predict on this GPU from its datasheet, measuring nothing: "
                                           f"{', '.join(HARDWARE)}")
    parser.add_argument("--hardware-file", type=Path, metavar="SPEC.toml",
                        help=f"the same from a TOML file with the fields {', '.join(FIELDS)}")
    parser.add_argument("--gpus-per-node", type=int, metavar="N", help="with --hardware: GPUs in one node (default 8)")
    parser.add_argument("--nodes", type=int, metavar="M", help="with --hardware: nodes (default 1)")


def wanted(args: argparse.Namespace) -> bool:
    """Whether the command asks for a prediction on hardware that is not here; cluster flags alone are refused."""
    if args.hardware or args.hardware_file:
        return True
    if args.gpus_per_node is not None or args.nodes is not None:
        raise ValueError("--gpus-per-node and --nodes describe the cluster of --hardware NAME or --hardware-file")
    return False


def spec_of(args: argparse.Namespace) -> Hardware:
    """The spec ``--hardware`` names or ``--hardware-file`` holds (one of them)."""
    if args.hardware and args.hardware_file:
        raise ValueError("give --hardware NAME or --hardware-file FILE, not both")
    if args.hardware_file:
        return spec_from_toml(args.hardware_file)
    if args.hardware.lower() not in HARDWARE:
        raise ValueError(f"--hardware: unknown GPU {args.hardware!r}; valid: {', '.join(HARDWARE)}")
    return HARDWARE[args.hardware.lower()]


def spec_from_toml(path: Path) -> Hardware:
    """A ``Hardware`` from a TOML file of its fields, every one given, each of its type."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    flag, valid = f"--hardware-file {path}", f"valid fields: {', '.join(FIELDS)}"
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"{flag}: {error.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{flag}: not TOML ({error})") from None
    unknown, missing = sorted(set(values) - set(FIELDS)), [name for name in FIELDS if name not in values]
    if unknown or missing:
        what = f"unknown field {', '.join(unknown)}" if unknown else f"missing field {', '.join(missing)}"
        raise ValueError(f"{flag}: {what}; {valid}")
    for name, value in values.items():
        _check_field(flag, name, value)
    return Hardware(**values)


def _check_field(flag: str, name: str, value) -> None:
    kind = FIELDS[name]
    if kind == "str":
        good = isinstance(value, str) and value.strip()
    elif kind == "bool":
        good = isinstance(value, bool)
    else:
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind != "int" or
                                                                                     isinstance(value, int))
        good = number and (value >= 0 if name in MAY_BE_ZERO else value > 0)
    if not good:
        wants = {"str": "a name", "bool": "true or false", "int": "a positive integer"}.get(
            kind, "a number >= 0" if name in MAY_BE_ZERO else "a positive number")
        raise ValueError(f"{flag}: field {name} must be {wants}, got {value!r}; valid fields: {', '.join(FIELDS)}")


def machine(spec: Hardware, world: int, gpus_per_node: int) -> Machine:
    """The cost model's ``Machine`` for ``world`` GPUs of ``spec``, packed ``gpus_per_node`` to a node: speeds at
    the achievable fractions of the peak, the node's link for every collective and group size, the network's for
    groups that span nodes, the memory less a worker's own."""
    from .plan import WORKER_PROCESS_BYTES

    inside, peak = spec.inside_link(), spec.bf16_tflops * 1e12
    hosts = tuple(rank // gpus_per_node for rank in range(world))
    return Machine(matmul_flops=peak * MATMUL_FRACTION, attention_flops=peak * ATTENTION_FRACTION,
                   all_reduce=inside, all_to_all=inside, send_recv=inside,
                   free_bytes=int(spec.memory_gib * 2**30) - WORKER_PROCESS_BYTES, element_bytes=BF16_BYTES,
                   overlap=GPU_RING_OVERLAP, rank_hosts=hosts if len(set(hosts)) > 1 else (),
                   host_links=tuple(("across", kind, spec.network_link()) for kind in LINK_KINDS))


def model_of(name: str | None) -> tuple[str, ModelCost]:
    """``--model``: a released model's name (its bf16 weights) or a transformer file (its header only)."""
    if name in RELEASES:
        return name, ModelCost.from_config(RELEASES[name], release_bf16_bytes(name))
    if not name or not Path(name).exists():
        raise ValueError(f"--model: with --hardware give a released model ({', '.join(RELEASES)}) or a transformer "
                         f"file; got {name!r}")
    return Path(name).name, ModelCost.from_file(name)


@functools.lru_cache(maxsize=None)
def release_bf16_bytes(name: str) -> int:
    """The bytes of a released model's bf16 file, from its tensors' shapes (``real_size.layout_bytes``)."""
    from .real_size import layout_bytes

    return layout_bytes(RELEASES[name], "bf16")


def step_flops(model: ModelCost, job: Job) -> float:
    """The FLOPs of one denoising step on one GPU (``block_flops`` of every block, each guidance pass)."""
    linear, attention = block_flops(model, job.video_tokens(model))
    return (2 if job.guidance else 1) * job.batch * model.layers * (linear + attention)


def floor_s(spec: Hardware, flops: float, gpus: int) -> float:
    """The physical floor of a step of ``flops``: every one of ``gpus`` GPUs at its dense bf16 peak."""
    return flops / (spec.bf16_tflops * 1e12 * gpus)


def run(args: argparse.Namespace) -> dict:
    """Every layout's prediction on the cluster, auto's choice at each GPU count, printed and (``--json``) written."""
    spec = spec_of(args)
    gpus_per_node, nodes = _positive(args.gpus_per_node, 8, "--gpus-per-node"), _positive(args.nodes, 1, "--nodes")
    if args.world is not None:
        raise ValueError("--world counts ranks on this machine; with --hardware give --gpus-per-node and --nodes")
    job = Job(_positive(args.width, 0, "--width"), _positive(args.height, 0, "--height"),
              _positive(args.frames, 0, "--frames"), steps=_positive(args.steps, 0, "--steps"),
              guidance=args.cfg != 1.0)
    name, model = model_of(args.model)
    world = gpus_per_node * nodes
    priced, flops = machine(spec, world, gpus_per_node), step_flops(model, job)
    result = {"hardware": dataclasses.asdict(spec), "gpus_per_node": gpus_per_node, "nodes": nodes, "world": world,
              "model": name, "weight_bytes": model.weight_bytes, "tokens": job.video_tokens(model),
              "job": {"width": job.width, "height": job.height, "frames": job.frames, "steps": job.steps,
                      "cfg": args.cfg}, "flops_per_step": flops, "floor_s": floor_s(spec, flops, world),
              "machine": dataclasses.asdict(priced), "note": NOTE}
    result.update(layouts_of(world, model, job, priced))
    result["by_gpus"] = by_gpu_count(spec, world, gpus_per_node, model, job)
    print_prediction(result, spec)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


def _positive(value: int | None, default: int, flag: str) -> int:
    value = default if value is None else value
    if value < 1:
        raise ValueError(f"{flag} must be a positive integer, got {value}")
    return value


def layouts_of(world: int, model: ModelCost, job: Job, priced: Machine) -> dict:
    """Every layout's row (fastest first, those that fit first) and auto's choice, or why none fits."""
    try:
        ranked, refusal = choose(world, model, job, priced), None
    except ValueError as error:
        ranked, refusal = rank_layouts(world, model, job, priced), str(error)
    chosen = None if refusal else ranked[0].layout.name()
    return {"layouts": [_row(p, world, model, job, p.layout.name() == chosen) for p in ranked], "chosen": chosen,
            "refusal": refusal}


def _row(prediction: Prediction, world: int, model: ModelCost, job: Job, chosen: bool) -> dict:
    layout = prediction.layout
    parts = memory_parts(layout, world, model, job, BF16_BYTES)
    return {"layout": layout.name(), "predicted_s": prediction.step_s, "compute_s": prediction.compute_s,
            "communication_s": prediction.communication_s,
            "memory_bytes": {**parts, "total": prediction.memory_bytes}, "fits": prediction.fits, "chosen": chosen,
            "tp": layout.tp, "ulysses": layout.ulysses, "ring": layout.ring, "cfg_parallel": layout.cfg_parallel,
            "vae_patch": layout.vae_patch,
            "cross_host": list(prediction.cross_host) if prediction.cross_host is not None else None}


def by_gpu_count(spec: Hardware, world: int, gpus_per_node: int, model: ModelCost, job: Job) -> list[dict]:
    """Auto's choice on every GPU count dividing ``world`` (packed into as few nodes as they fill), its speed-up
    over one GPU (the one GPU priced even where the model does not fit it) and the floor at that count."""
    rows, flops = [], step_flops(model, job)
    for gpus in (count for count in range(1, world + 1) if world % count == 0):
        best = rank_layouts(gpus, model, job, machine(spec, gpus, gpus_per_node))[0]
        rows.append({"gpus": gpus, "layout": best.layout.name(), "predicted_s": best.step_s, "fits": best.fits,
                     "floor_s": floor_s(spec, flops, gpus)})
    for row in rows:
        row["speed_up"] = rows[0]["predicted_s"] / row["predicted_s"]
    return rows


def print_prediction(result: dict, spec: Hardware) -> None:
    """The cluster, the figures it is priced at, every layout, auto's choice per GPU count, the floor."""
    priced, job = result["machine"], result["job"]
    print(f"{result['world']} x {spec.name} ({_nodes_text(result['nodes'], result['gpus_per_node'])}): "
          f"{spec.bf16_tflops:g} TFLOP/s bf16 dense, {spec.memory_gib:g} GiB at {spec.memory_gb_s:g} GB/s, "
          f"{spec.link_text()}; across nodes {spec.network_gb_s:g} GB/s per GPU")
    print(f"priced at: matmul {priced['matmul_flops'] / 1e12:.0f} TFLOP/s ({MATMUL_FRACTION:g} of peak), attention "
          f"{priced['attention_flops'] / 1e12:.0f} TFLOP/s ({ATTENTION_FRACTION:g}), collectives in a node "
          f"{_link_text(spec.inside_link())}, across nodes {_link_text(spec.network_link())}, "
          f"{priced['free_bytes'] / 2**30:.1f} GiB free per GPU")
    print(f"{result['model']} ({result['weight_bytes'] / 2**30:.2f} GiB), {job['width']}x{job['height']}, "
          f"{job['frames']} frames ({result['tokens']} tokens), {job['steps']} steps, cfg {job['cfg']:g}: "
          f"{result['flops_per_step'] / 1e15:.2f} PFLOP a step")
    print_layouts(result)
    print_by_gpus(result)
    print(f"physical floor on {result['world']} GPUs: {result['flops_per_step'] / 1e15:.2f} PFLOP a step / "
          f"({spec.bf16_tflops:g} TFLOP/s x {result['world']}) = {result['floor_s']:.3f} s/step")
    print(f"every figure above is {NOTE}")


def _nodes_text(nodes: int, gpus_per_node: int) -> str:
    return f"{nodes} node{'s' if nodes > 1 else ''} of {gpus_per_node}"


def _link_text(link: Link) -> str:
    return f"{link.bytes_per_s / 1e9:.1f} GB/s + {link.latency_s * 1e6:.0f} us a call"


def print_layouts(result: dict) -> None:
    several = any(row["cross_host"] is not None for row in result["layouts"])
    print(f"every layout of {result['world']} GPUs (predicted; GiB per GPU):")
    print(f"  {'layout':<46} {'s/step':>9} {'compute':>9} {'comm':>8} {'weights':>8} {'activ.':>7} {'total':>7}"
          f"  fits" + (f"  {CROSS_HOST_COLUMN}" if several else ""))
    for row in result["layouts"]:
        memory = {part: value / 2**30 for part, value in row["memory_bytes"].items()}
        crossing = f"  {', '.join(row['cross_host'] or ()) or 'none'}" if several else ""
        print(f"{'*' if row['chosen'] else ' '} {row['layout']:<46} {row['predicted_s']:>9.3f} "
              f"{row['compute_s']:>9.3f} {row['communication_s']:>8.3f} {memory['weights']:>8.2f} "
              f"{memory['activations']:>7.2f} {memory['total']:>7.2f}  {'yes' if row['fits'] else 'no':<4}"
              f"{crossing}".rstrip())
    chosen = next((row for row in result["layouts"] if row["chosen"]), None)
    if chosen is None:
        print(f"auto chose nothing: {result['refusal']}")
    else:
        print(f"auto chose: {chosen['layout']} (*), {chosen['predicted_s']:.3f} s/step, "
              f"{chosen['predicted_s'] * result['job']['steps']:.1f} s for {result['job']['steps']} steps")


def print_by_gpus(result: dict) -> None:
    print("auto's choice by GPU count (predicted):")
    print(f"  {'GPUs':>4}  {'layout':<46} {'s/step':>9} {'speed-up':>8} {'floor':>8}  fits")
    for row in result["by_gpus"]:
        print(f"  {row['gpus']:>4}  {row['layout']:<46} {row['predicted_s']:>9.3f} {row['speed_up']:>7.2f}x "
              f"{row['floor_s']:>8.3f}  {'yes' if row['fits'] else 'no'}")
    if not result["by_gpus"][0]["fits"]:
        print("  (the speed-ups are over one GPU priced as if the model fit it)")
