"""`wanmesh bench gpu` (and `tests/gpu/run.sh`): the CUDA path proven and measured on one GPU in one run; runs in
the CLI process and, for the two-rank check, in two ranks it spawns on the same device.

Correctness checks (each against a stated tolerance, written to the report with the error it found):

* ``cuda_tests``: the test suite's CUDA-only tests (GGUF dequantisation on the device), run by pytest;
* ``world1_vs_cpu``: the T2V transformer of the tiny and medium presets loaded on the device, fp32 (TF32 off) and
  bf16, against the CPU fp32 forward; the medium preset's scaled fp8, Q8_0 and Q4_K files kept quantized on the
  device against the same files dequantized on the CPU;
* ``attention_backends``: every local attention backend (``distributed/attention.py``) the device runs, output
  and log-sum-exp, against ``math`` in float32, with and without key padding;
* ``quantized_layers``: fp8, scaled fp8, GGUF Q8_0 and Q4_K linears kept as stored on the device against their
  CPU dequantisation (the weight bit for bit, the output within fp32 rounding);
* ``vae_decode``: the Wan 2.1 and 2.2 VAE decodes on the device against the CPU;
* ``two_ranks``: two ranks on one device (NCCL if it accepts two ranks on one GPU, else gloo over device tensors:
  the report says which) running tp 2 and ulysses 2, each against world 1.

Measurements (random bf16 weights, one warm-up call each and interleaved rounds: median, fastest, slowest): the
transformer forward of WanMesh world 1 (the loader's input hooks), WanMesh's attention seam (the context-parallel
processor at degree 1) and diffusers' WanTransformer3DModel at the Wan 2.1 1.3B shape and a slice of the 14B shape
at the 480p and 720p x 81 frames token counts: time, peak memory against the cost model's prediction, achieved
TFLOP/s (``auto_layout.block_flops``) against the device's bf16 peak, the attention share; kept fp8 and Q4_K
against bf16; loading the same model folder with WanMesh's loader and with diffusers' ``from_pretrained``;
``torch.compile`` on and off; the VAE decode time per frame at 480p. The targets are printed as pass
or miss, never failing the run.

Every section has its own time budget (an alarm interrupts it) and its own try/except; a global deadline skips the
sections left and says so. ``--dry-run`` runs everything on the CPU at the smallest sizes (what CI runs). The report
goes to ``gpu_report.json`` and ``gpu_report.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .common import Timing, time_interleaved
from .gpu_sampling_check import check_half_precision_sampling
from .releases import WAN_1_3B, WAN_14B, WAN_14B_LAYERS

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEADLINE_S = 330.0
EXIT_NO_CUDA = 2
DRY_RUN_BUDGET_FACTOR = 4  # section budgets are the GPU's; a busy CI CPU imports and spawns far slower

# Relative L2 error bars: ||device - reference|| / ||reference||.
FP32_TOLERANCE = 1e-4  # fp32 on the device (TF32 off) against CPU fp32: summation order only
BF16_TOLERANCE = 3e-2  # bf16 weights and activations against fp32 (bf16 keeps 8 bits of mantissa)
ATTENTION_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LSE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # largest absolute log-sum-exp difference
PARALLEL_TOLERANCE = 1e-4  # tp 2 / ulysses 2 against world 1, fp32: all-reduce summation order

# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) from the vendor's data sheets, by device name.
BF16_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0),
                    ("GH200", 989.0), ("A100", 312.0), ("L40S", 362.0), ("B200", 2250.0))

WAN_14B_SLICE = dict(WAN_14B, num_layers=4)  # dim 5120, 4 of 40 layers
VIDEO_SIZES = {"480p": (832, 480, 81), "720p": (1280, 720, 81)}  # width, height, frames

TARGETS = {
    "step_vs_diffusers": 1.0,  # WanMesh world 1 step / diffusers
    "step_vs_comfyui": 1.05,  # WanMesh world 1 step / ComfyUI's native Wan model
    "bf16_peak_share": 0.55,  # of the 14B slice's 720p forward
    "fp8_vs_bf16": 1.15,  # kept fp8 step / bf16 step
    "memory_vs_predicted": 1.1,  # peak memory / the cost model's weights + activations
}


@dataclass
class Sizes:
    """What one run checks and measures at: the GPU's sizes, or the dry run's smallest."""

    presets: tuple[str, ...]
    check_latent: tuple[int, ...]  # the world 1 / two-rank checks' latent
    attention_shape: tuple[int, int, int, int]  # [batch, seq, heads, head_dim]
    vae_latent_frames: int
    vae_latent_hw: tuple[int, int]
    step_models: dict[str, dict]  # name: transformer config of the step measurements
    step_sizes: dict[str, tuple[int, int, int]]  # name: (width, height, frames)
    quantized_model: dict
    quantized_size: str
    vae_time_config: dict | None  # None: the Wan 2.1 VAE's own config
    vae_time_latent: tuple[int, ...]
    repeats: int


GPU_SIZES = Sizes(
    presets=("tiny", "medium"), check_latent=(1, 16, 5, 16, 16), attention_shape=(1, 4096, 12, 128),
    vae_latent_frames=3, vae_latent_hw=(16, 16),
    step_models={"Wan 2.1 1.3B": WAN_1_3B,
                 f"Wan 14B slice ({WAN_14B_SLICE['num_layers']} of {WAN_14B_LAYERS} layers)": WAN_14B_SLICE},
    step_sizes=VIDEO_SIZES, quantized_model=dict(WAN_1_3B, num_layers=2), quantized_size="480p",
    vae_time_config=None, vae_time_latent=(1, 16, 6, 60, 104), repeats=3,
)


def _dry_run_sizes() -> Sizes:
    from ..tiny.models import TINY_TRANSFORMER

    small = dict(TINY_TRANSFORMER, num_layers=2)
    dim256 = dict(TINY_TRANSFORMER, num_attention_heads=2, attention_head_dim=128, ffn_dim=512, num_layers=1)
    return Sizes(
        presets=("tiny",), check_latent=(1, 16, 2, 8, 8), attention_shape=(1, 96, 2, 32),
        vae_latent_frames=1, vae_latent_hw=(4, 4),
        step_models={"tiny": small, "tiny slice": dict(small, num_layers=1)},
        step_sizes={"64x48x5": (64, 48, 5)}, quantized_model=dim256, quantized_size="64x48x5",
        vae_time_config="tiny", vae_time_latent=(1, 16, 1, 4, 4), repeats=1,
    )


# -- the run: sections, budgets, the deadline -------------------------------------------------------------------


class SectionTimeout(Exception):
    """A section ran past its own time budget."""


@dataclass
class Run:
    device: torch.device
    dry_run: bool
    sizes: Sizes
    deadline: float  # time.monotonic() after which no section starts
    work: Path  # a temporary folder for model files
    report: dict = field(default_factory=dict)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


def _on_alarm(signum, frame):
    raise SectionTimeout("ran past its time budget")


def run_section(run: Run, kind: str, name: str, budget_s: float, function: Callable[[Run], dict]) -> dict:
    """Run one section under min(its budget, the time left) and record its result, error or skip."""
    entry: dict = {"name": name}
    left = run.remaining()
    if left < min(budget_s, 10.0):
        entry.update(status="skipped", reason=f"global deadline: {max(left, 0):.0f} s left")
        run.report["skipped_for_deadline"].append(name)
        run.report[kind].append(entry)
        print(f"[gpu check] {name}: skipped (global deadline)", flush=True)
        return entry
    limit = min(budget_s * (DRY_RUN_BUDGET_FACTOR if run.dry_run else 1), left)
    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        entry.update(function(run))
        entry.setdefault("status", "pass" if kind == "checks" else "done")
    except SectionTimeout:
        entry.update(status="error", error=f"ran past its {limit:.0f} s budget")
    except Exception as error:  # noqa: BLE001 - one section's failure is reported; the others still run
        entry.update(status="error", error=f"{type(error).__name__}: {str(error).strip()[:300]}",
                     traceback=traceback.format_exc()[-3000:])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
            torch.cuda.empty_cache()
    entry["seconds"] = round(time.monotonic() - start, 2)
    run.report[kind].append(entry)
    print(f"[gpu check] {name}: {entry['status']} ({entry['seconds']} s)"
          + (f" - {entry['error']}" if "error" in entry else ""), flush=True)
    return entry


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    value, reference = value.detach().double().cpu(), reference.detach().double().cpu()
    return float(torch.linalg.vector_norm(value - reference) / torch.linalg.vector_norm(reference).clamp_min(1e-30))


def _verdict(rows: list[dict]) -> dict:
    """A check passes when every row is within its tolerance."""
    return {"status": "pass" if rows and all(row["ok"] for row in rows) else "fail", "rows": rows}


def _row(what: str, error: float, tolerance: float, **extra) -> dict:
    return {"what": what, "error": error, "tolerance": tolerance, "ok": bool(error <= tolerance), **extra}


@contextlib.contextmanager
def _no_tf32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


# -- model files ------------------------------------------------------------------------------------------------


def _transformer_state(model: torch.nn.Module, config: dict) -> dict[str, torch.Tensor]:
    from ..tiny.models import original_state_dict, original_transformer_names
    from ..weights.loaders import convert_wan_transformer_keys

    return original_state_dict(model, original_transformer_names(config), convert_wan_transformer_keys)


def _write_transformer(run: Run, preset: str) -> dict[str, Path]:
    """The preset's T2V transformer as files (tiny: fp32; medium: bf16, scaled fp8, Q8_0 and Q4_K GGUF, as
    ``make-tiny --preset medium`` writes them); written once per run."""
    from gguf import GGMLQuantizationType as Q

    from ..tensor_files import save_tensors_atomic
    from ..tiny.fp8_write import write_fp8_file
    from ..tiny.gguf_write import write_wan_gguf
    from ..tiny.models import MEDIUM_TRANSFORMER, SEED, TINY_TRANSFORMER, build_medium_transformer, randomise_

    folder = run.work / preset
    if (folder / "done").is_file():
        return {path.stem: path for path in folder.iterdir() if path.name != "done"}
    from diffusers import WanTransformer3DModel

    if preset == "tiny":
        config = TINY_TRANSFORMER
        model = WanTransformer3DModel(**config)
        randomise_(model, SEED)
        state = _transformer_state(model.eval(), config)
    else:
        config = MEDIUM_TRANSFORMER
        state = {k: v.to(torch.bfloat16) for k, v in _transformer_state(build_medium_transformer(), config).items()}
    heads = {"num_heads": str(config["num_attention_heads"])}
    paths = {"model": save_tensors_atomic(state, folder / "model.safetensors", metadata=heads)}
    if preset == "medium":
        paths["fp8_scaled"] = write_fp8_file(state, folder / "fp8_scaled.safetensors", torch.float8_e4m3fn,
                                             scaled=True, metadata=heads)
        for name, qtype in (("Q8_0", Q.Q8_0), ("Q4_K", Q.Q4_K)):
            write_wan_gguf(state, folder / f"{name}.gguf", qtype, num_heads=config["num_attention_heads"])
            paths[name] = folder / f"{name}.gguf"
    (folder / "done").write_text("")
    return {name: Path(path) for name, path in paths.items()}


def _check_inputs(model_config, latent_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    from ..config import TEXT_TOKENS

    generator = torch.Generator().manual_seed(3)
    return {"hidden_states": torch.randn(latent_shape, generator=generator),
            "encoder_hidden_states": torch.randn(1, TEXT_TOKENS, model_config.text_dim, generator=generator),
            "timestep": torch.tensor([500.0])}


def _forward(model: torch.nn.Module, inputs: dict[str, torch.Tensor], device, dtype) -> torch.Tensor:
    moved = {key: value.to(device, dtype if value.is_floating_point() and key != "timestep" else value.dtype)
             for key, value in inputs.items()}
    with torch.no_grad():
        return model(**moved, return_dict=False)[0].float().cpu()


# -- checks -----------------------------------------------------------------------------------------------------


def check_cuda_tests(run: Run) -> dict:
    """The suite's CUDA-only tests (``test_cuda_*``), run by pytest in a child process."""
    with tempfile.TemporaryDirectory() as folder:
        junit = Path(folder, "junit.xml")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--confcutdir=tests",
                   "-o", "addopts=", "-k", "cuda", f"--junitxml={junit}", "tests/unit/test_dequant.py"]
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=max(run.remaining() - 5, 10))
        if not junit.is_file():
            raise RuntimeError(f"pytest wrote no report (exit {result.returncode}): "
                               f"{(result.stdout + result.stderr).strip()[-300:]}")
        suite = ElementTree.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    summary = {"command": " ".join(command[1:]).replace(f"--junitxml={junit} ", ""), **counts}
    if counts["tests"] == 0 or counts["failures"] or counts["errors"]:
        return {"status": "fail", **summary, "output": (result.stdout + result.stderr)[-2000:]}
    if counts["skipped"] == counts["tests"]:
        return {"status": "skipped", "reason": f"no CUDA device: {counts['tests']} collected, all skipped", **summary}
    return {"status": "pass" if counts["skipped"] == 0 else "fail", **summary}


def check_world1_vs_cpu(run: Run) -> dict:
    """Each preset's transformer loaded on the device against the CPU fp32 forward of the same file; the medium
    preset's quantized files kept as stored on the device against the same file dequantized on the CPU."""
    from ..weights.loaders import load_transformer

    rows = []
    for preset in run.sizes.presets:
        paths = _write_transformer(run, preset)
        reference_model = load_transformer(str(paths["model"]), dtype=torch.float32, device="cpu")
        inputs = _check_inputs(reference_model.config, run.sizes.check_latent)
        reference = _forward(reference_model, inputs, "cpu", torch.float32)
        del reference_model
        for dtype, tolerance in ((torch.float32, FP32_TOLERANCE), (torch.bfloat16, BF16_TOLERANCE)):
            model = load_transformer(str(paths["model"]), dtype=dtype, device=run.device)
            with _no_tf32():
                output = _forward(model, inputs, run.device, dtype)
            rows.append(_row(f"{preset} {str(dtype).removeprefix('torch.')}", relative_error(output, reference),
                             tolerance))
            del model
        for name in ("fp8_scaled", "Q8_0", "Q4_K"):
            if name not in paths:
                continue
            cpu = load_transformer(str(paths[name]), dtype=torch.float32, device="cpu", weights="dequantize")
            expected = _forward(cpu, inputs, "cpu", torch.float32)
            del cpu
            kept = load_transformer(str(paths[name]), dtype=torch.bfloat16, device=run.device, weights="keep")
            rows.append(_row(f"{preset} {name} kept, bf16", relative_error(_forward(kept, inputs, run.device,
                                                                                    torch.bfloat16), expected),
                             BF16_TOLERANCE))
            del kept
    return _verdict(rows)


def attention_backends(device: torch.device) -> list[str]:
    """The local backends this device runs: CPU flash and math on a CPU; on CUDA flash-attn (when importable),
    PyTorch's flash, cuDNN and memory-efficient SDPA, and math."""
    from ..distributed.attention import _flash_attn_func

    if device.type != "cuda":
        return ["cpu_flash", "math"]
    return (["flash_attn"] if _flash_attn_func() is not None else []) + ["sdpa_flash", "sdpa_cudnn",
                                                                           "sdpa_efficient", "math"]


@_no_tf32()  # math's einsum in float32 must not run in TF32 on the GPU
def check_attention_backends(run: Run) -> dict:
    from ..distributed.attention import attention, select_backend

    batch, seq, heads, head_dim = run.sizes.attention_shape
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(batch, seq, heads, head_dim, generator=generator) for _ in range(3))
    rows, unavailable = [], {}
    selected = {}
    for dtype in (torch.bfloat16, torch.float32):
        qd, kd, vd = (x.to(run.device, dtype) for x in (q, k, v))
        selected[str(dtype).removeprefix("torch.")] = select_backend(qd)
        for padding in (0, 3):
            # the reference: math in float64, from the same (rounded) inputs
            ref_out, ref_lse = attention(*(x.double() for x in (qd, kd, vd)), key_padding=padding,
                                         return_lse=True, backend="math")
            ref_lse = ref_lse.cpu()
            for backend in attention_backends(run.device):
                try:
                    out, lse = attention(qd, kd, vd, key_padding=padding, return_lse=True, backend=backend)
                except Exception as error:  # noqa: BLE001 - a kernel this build or device lacks for this dtype
                    unavailable[f"{backend} {dtype}"] = str(error).strip().splitlines()[0][:200]
                    continue
                lse_error = float((lse.double().cpu() - ref_lse).abs().max())
                rows.append(_row(f"{backend} {str(dtype).removeprefix('torch.')} key padding {padding}",
                                 relative_error(out, ref_out), ATTENTION_TOLERANCE[dtype], lse_error=lse_error,
                                 lse_tolerance=LSE_TOLERANCE[dtype]))
                rows[-1]["ok"] = rows[-1]["ok"] and lse_error <= LSE_TOLERANCE[dtype]
    selected_ran = all(any(row["what"].startswith(f"{name} {dt}") for row in rows) for dt, name in selected.items())
    result = _verdict(rows)
    if not selected_ran:
        result["status"] = "fail"
    return {**result, "selected": selected, "unavailable": unavailable, "shape": list(run.sizes.attention_shape)}


def _stored_weights(weight: torch.Tensor) -> dict:
    """``weight`` [out, in] in each stored form (StoredTensor on the CPU)."""
    from gguf import GGMLQuantizationType as Q

    from ..tiny.gguf_write import quantize
    from ..weights.quantized import FP8, StoredTensor

    forms = {}
    fp8 = weight.to(torch.float8_e4m3fn)
    forms["fp8 e4m3fn"] = StoredTensor(fp8, FP8, tuple(weight.shape))
    scale = weight.abs().max() / 448.0
    forms["scaled fp8"] = StoredTensor((weight / scale).to(torch.float8_e4m3fn), FP8, tuple(weight.shape),
                                       scale.reshape(1).float())
    forms["fp8 e5m2"] = StoredTensor(weight.to(torch.float8_e5m2), FP8, tuple(weight.shape))
    for name, qtype in (("GGUF Q8_0", Q.Q8_0), ("GGUF Q4_K", Q.Q4_K)):
        data = torch.from_numpy(quantize(weight.numpy(), qtype).view("uint8").copy())
        forms[name] = StoredTensor(data, qtype, tuple(weight.shape))
    return forms


def check_quantized_layers(run: Run) -> dict:
    from ..weights.quantized import dequantize_stored, hold_stored_

    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(256, 512, generator=generator) * 0.02
    weight[3] *= 30  # an outlier row spreads the block scales
    x = torch.randn(7, 512, generator=generator)
    rows = []
    for name, stored in _stored_weights(weight).items():
        expected = x.double() @ dequantize_stored(stored.data, stored.qtype, stored.shape, torch.float64
                                                  if stored.qtype == "fp8" else torch.float32, stored.scale).double().T
        for dtype, tolerance in ((torch.float32, FP32_TOLERANCE), (torch.bfloat16, BF16_TOLERANCE)):
            cpu_weight = dequantize_stored(stored.data, stored.qtype, stored.shape, dtype, stored.scale)
            layer = torch.nn.Linear(512, 256, bias=False)
            hold_stored_(layer, stored, dtype, run.device)
            with torch.no_grad(), _no_tf32():
                device_weight = layer.weight  # dequantised on the device
                output = layer(x.to(run.device, dtype))
            same_bits = bool(torch.equal(device_weight.cpu(), cpu_weight))
            rows.append(_row(f"{name} {str(dtype).removeprefix('torch.')}", relative_error(output, expected), tolerance,
                             weight_bit_exact=same_bits))
            rows[-1]["ok"] = rows[-1]["ok"] and same_bits
    return _verdict(rows)


def _write_vaes(run: Run) -> dict[str, Path]:
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from ..tensor_files import save_tensors_atomic
    from ..tiny.models import SEED, TINY_VAE, original_state_dict, original_vae_names, randomise_
    from ..tiny.vae22 import write_tiny_vae22

    vae = AutoencoderKLWan(**TINY_VAE)
    randomise_(vae, SEED + 2)
    state = original_state_dict(vae.eval(), original_vae_names(TINY_VAE), convert_wan_vae_to_diffusers)
    return {"2.1": save_tensors_atomic(state, run.work / "vae" / "wan21_tiny_vae.safetensors"),
            "2.2": write_tiny_vae22(run.work / "vae22")}


def _vae_dtypes(device: torch.device) -> tuple:
    # bf16 3D convolutions on a CPU are too slow for the dry run: float32 only there
    return ((torch.float32, FP32_TOLERANCE),) + (((torch.bfloat16, BF16_TOLERANCE),) if device.type == "cuda" else ())


def check_vae_decode(run: Run) -> dict:
    from ..weights.loaders import load_vae

    rows = []
    for version, path in _write_vaes(run).items():
        reference_vae = load_vae(str(path), dtype=torch.float32, device="cpu")
        channels = reference_vae.config.z_dim
        latent = torch.randn(1, channels, run.sizes.vae_latent_frames, *run.sizes.vae_latent_hw,
                             generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            reference = reference_vae.decode(latent, return_dict=False)[0]
        for dtype, tolerance in _vae_dtypes(run.device):
            vae = load_vae(str(path), dtype=dtype, device=run.device)
            with torch.no_grad(), _no_tf32():
                output = vae.decode(latent.to(run.device, dtype), return_dict=False)[0]
            rows.append(_row(f"VAE {version} {str(dtype).removeprefix('torch.')}", relative_error(output, reference),
                             tolerance, frames=int(output.shape[2])))
    return _verdict(rows)


# -- two ranks on one device ------------------------------------------------------------------------------------


def spawn_pair(function: Callable, args: tuple, backend: str, device: torch.device, deadline_s: float) -> None:
    """``function(rank, device, *args)`` on two ranks that share ``device``, killed at the deadline."""
    from ..distributed.spawn import spawn_ranks

    spawn_ranks(_on_shared_device, 2, args=(function, str(device), args), device=str(device), deadline_s=deadline_s,
                pg_timeout_s=120.0, backend=backend)


def _on_shared_device(rank: int, world: int, function: Callable, device: str, args: tuple) -> None:
    function(rank, torch.device(device), *args)


def _nccl_probe(rank: int, device: torch.device) -> None:
    import torch.distributed as dist

    value = torch.ones(4, device=device) * (rank + 1)
    dist.all_reduce(value)
    torch.cuda.synchronize(device)
    if not torch.all(value == 3):
        raise RuntimeError(f"NCCL all-reduce on one device gave {value.tolist()}")


def _two_rank_main(rank: int, device: torch.device, model_path: str, inputs_path: str, folder: str) -> None:
    """tp 2, then ulysses 2, each one forward in fp32 (TF32 off); rank 0 writes the outputs."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from ..distributed.context_parallel import apply_context_parallel
    from ..tensor_files import save_tensors_atomic
    from ..weights.loaders import load_transformer
    from ..weights.sharded import load_transformer_tp

    inputs = load_file(inputs_path)
    outputs, errors = {}, {}
    loaders = {"tp 2": lambda: load_transformer_tp(model_path, dtype=torch.float32, device=device,
                                                   tp_group=dist.group.WORLD),
               "ulysses 2": lambda: apply_context_parallel(
                   load_transformer(model_path, dtype=torch.float32, device=device), ulysses_group=dist.group.WORLD)}
    for name, load in loaders.items():
        try:
            with _no_tf32():
                outputs[name] = _forward(load(), inputs, device, torch.float32)
        except Exception as error:  # noqa: BLE001 - reported; the other layout still runs
            errors[name] = f"{type(error).__name__}: {str(error).strip()[:300]}"
    if rank == 0:
        save_tensors_atomic(outputs, Path(folder, "outputs.safetensors"))
        Path(folder, "errors.json").write_text(json.dumps(errors))


def check_two_ranks(run: Run) -> dict:
    from safetensors.torch import load_file

    from ..tensor_files import save_tensors_atomic
    from ..weights.loaders import load_transformer

    path = str(_write_transformer(run, "tiny")["model"])
    world1 = load_transformer(path, dtype=torch.float32, device=run.device)
    inputs = _check_inputs(world1.config, run.sizes.check_latent)
    with _no_tf32():
        reference = _forward(world1, inputs, run.device, torch.float32)
    del world1
    backend, nccl_error = "gloo", None
    if run.device.type == "cuda":
        try:
            spawn_pair(_nccl_probe, (), "nccl", run.device, deadline_s=min(60.0, run.remaining() / 3))
            backend = "nccl"
        except Exception as error:  # noqa: BLE001 - NCCL refusing two ranks on one GPU: gloo instead
            lines = str(error).strip().splitlines()
            nccl_error = f"{type(error).__name__}: {lines[-1][:300] if lines else ''}"
    with tempfile.TemporaryDirectory() as folder:
        inputs_path = save_tensors_atomic(inputs, Path(folder, "inputs.safetensors"))
        spawn_pair(_two_rank_main, (path, str(inputs_path), folder), backend, run.device,
                   deadline_s=max(run.remaining() - 5, 10))
        outputs = load_file(Path(folder, "outputs.safetensors"))
        errors = json.loads(Path(folder, "errors.json").read_text())
    rows = [_row(f"{name} ({backend}) vs world 1", relative_error(outputs[name], reference), PARALLEL_TOLERANCE)
            for name in ("tp 2", "ulysses 2") if name in outputs]
    result = _verdict(rows)
    if errors:
        result["status"] = "fail"
    return {**result, "backend": backend, "nccl_on_one_device": backend == "nccl", "nccl_error": nccl_error,
            "errors": errors}


# -- measurements -----------------------------------------------------------------------------------------------


def bf16_peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_TFLOPS if key in name), None)


def latent_of(size: tuple[int, int, int]) -> tuple[int, int, int, int, int]:
    from ..config import latent_shape

    return tuple(latent_shape(*size))


def _model_cost(config: dict, weight_bytes: int):
    from ..auto_layout import ModelCost

    return ModelCost(layers=config["num_layers"], heads=config["num_attention_heads"],
                     head_dim=config["attention_head_dim"], ffn_dim=config["ffn_dim"], weight_bytes=weight_bytes,
                     patch=tuple(config["patch_size"]))


def forward_flops(config: dict, tokens: int) -> float:
    """One forward pass's FLOPs, from the cost model's per-block count."""
    from ..auto_layout import block_flops

    linear, attention = block_flops(_model_cost(config, 0), tokens)
    return config["num_layers"] * (linear + attention)


def predicted_bytes(config: dict, tokens: int, weight_bytes: int) -> int:
    """The cost model's memory on one rank: the weights plus one block's activations (bf16)."""
    from ..auto_layout import activation_bytes

    return weight_bytes + activation_bytes(1, tokens, config["num_attention_heads"] * config["attention_head_dim"], 2)


def _random_model(config: dict, device: torch.device) -> torch.nn.Module:
    """Random weights in bf16, the modules diffusers keeps in float32 kept so, as WanMesh's loader and diffusers'
    ``from_pretrained`` both do."""
    from diffusers import WanTransformer3DModel

    from ..weights.checkpoint import _keeps_float32

    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(**config)
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    for name, parameter in model.named_parameters():
        parameter.data = parameter.data.to(torch.float32 if _keeps_float32(name, keep) else torch.bfloat16)
    return model.eval().requires_grad_(False)


def _step_inputs(config: dict, size: tuple[int, int, int], device) -> dict[str, torch.Tensor]:
    from ..config import TEXT_TOKENS

    generator = torch.Generator(device).manual_seed(0)
    return {"hidden_states": torch.randn(latent_of(size), generator=generator, device=device, dtype=torch.bfloat16),
            "encoder_hidden_states": torch.randn(1, TEXT_TOKENS, config["text_dim"], generator=generator,
                                                 device=device, dtype=torch.bfloat16),
            "timestep": torch.tensor([500.0], device=device)}


def _forward_function(model, inputs) -> Callable[[], object]:
    def forward():
        with torch.no_grad():
            return model(**inputs, return_dict=False)[0]

    return forward


def _with_attention_seam(model: torch.nn.Module) -> torch.nn.Module:
    """WanMesh's context-parallel attention processor installed at degree 1: WanMesh's own attention kernel seam
    (``distributed/attention.py``) in every self-attention, as ranks run it."""
    from ..distributed.context_parallel import ContextParallel, context_parallel_plan

    context = ContextParallel(None, None)
    context.install(model, context_parallel_plan(model))
    model.context_parallel = context
    return model


def _peak_bytes(function: Callable[[], object], device: torch.device, weight_bytes: int) -> int | None:
    """One model's peak: its weights plus the most the call allocated beyond what was allocated before."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    function()
    torch.cuda.synchronize(device)
    return weight_bytes + torch.cuda.max_memory_allocated(device) - before


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _timing_row(timing: Timing) -> dict:
    return {"median_s": timing.median, "min_s": timing.low, "max_s": timing.high}


def measure_transformer_step(run: Run) -> dict:
    """WanMesh world 1, its attention seam and diffusers' forward on the same weights, interleaved; per model and
    token count: times, peak memory against the prediction, TFLOP/s, the attention share."""
    from ..distributed.attention import attention, select_backend
    from ..networks.wan_inputs import with_native_inputs

    rows, peak = [], bf16_peak_tflops(run.device)
    for model_name, config in run.sizes.step_models.items():
        diffusers_model = _random_model(config, run.device)
        weights = _weight_bytes(diffusers_model)
        variants = {"diffusers": diffusers_model, "WanMesh world 1": with_native_inputs(copy.deepcopy(diffusers_model)),
                    "WanMesh attention seam": _with_attention_seam(copy.deepcopy(diffusers_model))}
        for size_name, size in run.sizes.step_sizes.items():
            inputs = _step_inputs(config, size, run.device)
            tokens = math.prod(latent_of(size)[2:]) // math.prod(config["patch_size"])
            functions = {name: _forward_function(model, inputs) for name, model in variants.items()}
            timings = time_interleaved(functions, run.device, run.sizes.repeats)
            flops = forward_flops(config, tokens)
            heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
            q = torch.randn(1, tokens, heads, head_dim, device=run.device, dtype=torch.bfloat16)
            attention_time = time_interleaved({"attention": lambda: attention(q, q, q)}, run.device,
                                              run.sizes.repeats)["attention"]
            predicted = predicted_bytes(config, tokens, weights)
            for name, timing in timings.items():
                peak_bytes = _peak_bytes(functions[name], run.device, weights)
                rows.append({"model": model_name, "size": size_name, "tokens": tokens, "variant": name,
                             **_timing_row(timing), "layers": config["num_layers"],
                             "per_layer_ms": 1000 * timing.median / config["num_layers"],
                             "tflops": flops / timing.median / 1e12,
                             "bf16_peak_share": None if peak is None else flops / timing.median / 1e12 / peak,
                             "attention_share": min(1.0, attention_time.median * config["num_layers"] / timing.median),
                             "attention_backend": select_backend(q), "peak_bytes": peak_bytes,
                             "predicted_bytes": predicted,
                             "memory_vs_predicted": None if peak_bytes is None else peak_bytes / predicted})
            del inputs, q
        del variants, diffusers_model
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "bf16_peak_tflops": peak}


def measure_load(run: Run) -> dict:
    """The same diffusers model folder (bf16) loaded onto the device by WanMesh's loader and by diffusers'
    ``from_pretrained``, interleaved (the files stay in the page cache after the warm-up)."""
    from diffusers import WanTransformer3DModel

    from ..tiny.models import MEDIUM_TRANSFORMER, TINY_TRANSFORMER, randomise_
    from ..weights.loaders import load_transformer

    config = TINY_TRANSFORMER if run.dry_run else MEDIUM_TRANSFORMER
    model = WanTransformer3DModel(**config)
    randomise_(model, 7)
    folder = run.work / "load_folder"
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    del model
    functions = {"WanMesh load_transformer": lambda: load_transformer(str(folder), dtype=torch.bfloat16,
                                                                      device=run.device),
                 "diffusers from_pretrained": lambda: WanTransformer3DModel.from_pretrained(
                     folder, torch_dtype=torch.bfloat16).to(run.device)}
    timings = time_interleaved(functions, run.device, run.sizes.repeats)
    return {"model": "tiny" if run.dry_run else "medium (143M)",
            "rows": [{"loader": name, **_timing_row(t)} for name, t in timings.items()]}


def _keep_quantized_(model: torch.nn.Module, form: str) -> torch.nn.Module:
    """Every block linear held as ``form`` stores it (fp8 scaled or GGUF Q4_K), dequantised per matmul as
    WanMesh's "keep" weights mode does."""
    from gguf import GGMLQuantizationType as Q

    from ..tiny.gguf_write import quantize
    from ..weights.quantized import FP8, StoredTensor, hold_stored_, keeps_quantized

    device = next(model.parameters()).device
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or not keeps_quantized(f"{name}.weight", ("blocks.",)):
            continue
        weight = module.weight.detach().float()
        if form == "fp8 scaled":
            scale = (weight.abs().max() / 448.0).clamp_min(1e-12)
            stored = StoredTensor((weight / scale).to(torch.float8_e4m3fn), FP8, tuple(weight.shape),
                                  scale.reshape(1))
        else:
            data = quantize(weight.cpu().numpy(), Q.Q4_K).view("uint8")
            stored = StoredTensor(torch.from_numpy(data.copy()), Q.Q4_K, tuple(weight.shape))
        hold_stored_(module, stored, torch.bfloat16, device)
    return model


def measure_quantized_step(run: Run) -> dict:
    config, size = run.sizes.quantized_model, run.sizes.step_sizes[run.sizes.quantized_size]
    bf16 = _random_model(config, run.device)
    variants = {"bf16": bf16}
    for form in ("fp8 scaled", "Q4_K"):
        variants[form] = _keep_quantized_(copy.deepcopy(bf16), form)
    inputs = _step_inputs(config, size, run.device)
    timings = time_interleaved({name: _forward_function(model, inputs) for name, model in variants.items()},
                               run.device, run.sizes.repeats)
    base = timings["bf16"].median
    rows = [{"weights": name, **_timing_row(t), "vs_bf16": t.median / base,
             "weight_bytes": _weight_bytes(variants[name])} for name, t in timings.items()]
    return {"rows": rows, "model_layers": config["num_layers"], "size": run.sizes.quantized_size}


def measure_compile(run: Run) -> dict:
    """The first model's first size with every block compiled (``torch.compile``) against eager."""
    from ..networks.wan_inputs import with_native_inputs

    (model_name, config), (size_name, size) = (next(iter(run.sizes.step_models.items())),
                                               next(iter(run.sizes.step_sizes.items())))
    eager = _random_model(config, run.device)
    compiled = copy.deepcopy(eager)
    eager, compiled = with_native_inputs(eager), with_native_inputs(compiled)
    backend = "eager" if run.dry_run else "inductor"  # the dry run proves the capture only (no C++ compile)
    for index, block in enumerate(compiled.blocks):
        compiled.blocks[index] = torch.compile(block, backend=backend)
    inputs = _step_inputs(config, size, run.device)
    start = time.monotonic()
    _forward_function(compiled, inputs)()
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    compile_s = time.monotonic() - start
    timings = time_interleaved({"eager": _forward_function(eager, inputs),
                                "compiled": _forward_function(compiled, inputs)}, run.device, run.sizes.repeats)
    output_error = relative_error(_forward_function(compiled, inputs)(), _forward_function(eager, inputs)())
    return {"model": model_name, "size": size_name, "backend": backend, "compile_s": compile_s,
            "output_error_vs_eager": output_error,
            "rows": [{"mode": name, **_timing_row(t)} for name, t in timings.items()],
            "compiled_vs_eager": timings["compiled"].median / timings["eager"].median}


def measure_vae_decode(run: Run) -> dict:
    from diffusers import AutoencoderKLWan

    from ..tiny.models import TINY_VAE

    config = TINY_VAE if run.sizes.vae_time_config == "tiny" else {}
    torch.manual_seed(0)
    with torch.device(run.device):
        vae = AutoencoderKLWan(**config)
    dtype = torch.bfloat16 if run.device.type == "cuda" else torch.float32
    vae = vae.to(dtype).eval()
    latent = torch.randn(run.sizes.vae_time_latent, device=run.device, dtype=dtype)

    def decode():
        with torch.no_grad():
            return vae.decode(latent, return_dict=False)[0]

    frames = (latent.shape[2] - 1) * 4 + 1
    timing = time_interleaved({"decode": decode}, run.device, max(1, run.sizes.repeats - 1))["decode"]
    peak = _peak_bytes(decode, run.device, _weight_bytes(vae))
    height, width = latent.shape[3] * 8, latent.shape[4] * 8
    return {"vae": "Wan 2.1 (random weights)" if not config else "tiny Wan 2.1",
            "dtype": str(dtype).removeprefix("torch."),
            "video": f"{width}x{height}x{frames}", **_timing_row(timing), "per_frame_s": timing.median / frames,
            "peak_bytes": peak}


# -- targets and the report -------------------------------------------------------------------------------------


def _section(report: dict, name: str) -> dict | None:
    return next((entry for entry in report["measurements"] if entry["name"] == name and entry["status"] == "done"),
                None)


def evaluate_targets(report: dict, dry_run: bool) -> list[dict]:
    """Each target with the value the run measured: pass, miss, or not measured (never a failure)."""
    targets = []

    def add(name: str, target: str, value: float | None, ok: bool | None, note: str = "") -> None:
        result = "not measured" if value is None else ("n/a (dry run)" if dry_run else ("pass" if ok else "miss"))
        targets.append({"name": name, "target": target, "value": value, "result": result, "note": note})

    step = _section(report, "transformer_step")
    step_rows = step["rows"] if step else []
    by_key = {(r["model"], r["size"], r["variant"]): r for r in step_rows}
    for (model, size, variant), row in by_key.items():
        if variant != "WanMesh world 1":
            continue
        ratio = row["median_s"] / by_key[(model, size, "diffusers")]["median_s"]
        add(f"WanMesh world 1 / diffusers step, {model} {size}", f"<= {TARGETS['step_vs_diffusers']}", ratio,
            ratio <= TARGETS["step_vs_diffusers"])
        if row["memory_vs_predicted"] is not None or dry_run:
            value = row["memory_vs_predicted"]
            add(f"peak memory / cost model, {model} {size}", f"<= {TARGETS['memory_vs_predicted']}", value,
                value is not None and value <= TARGETS["memory_vs_predicted"])
    add("WanMesh world 1 / ComfyUI native step", f"<= {TARGETS['step_vs_comfyui']}", None, None,
        "ComfyUI is not carried to the GPU machine")
    slice_720 = [r for r in step_rows if "slice" in r["model"] and r["variant"] == "WanMesh world 1"]
    if slice_720:
        share = slice_720[-1]["bf16_peak_share"]
        add(f"share of bf16 peak, {slice_720[-1]['model']} {slice_720[-1]['size']}",
            f">= {TARGETS['bf16_peak_share']}", share, share is not None and share >= TARGETS["bf16_peak_share"],
            "" if share is not None or dry_run else "the device's bf16 peak is not in the table")
    quantized = _section(report, "quantized_step")
    fp8 = next((r["vs_bf16"] for r in quantized["rows"] if r["weights"] == "fp8 scaled"), None) if quantized else None
    add("kept fp8 / bf16 step", f"<= {TARGETS['fp8_vs_bf16']}", fp8, fp8 is not None and fp8 <= TARGETS["fp8_vs_bf16"])
    return targets


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _gib(value) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def markdown(report: dict) -> str:
    device = report["device"]
    lines = [f"## GPU check ({report['mode']})", "",
             f"{report['date']}, commit {report['commit'] or '-'}, {device['name']}, torch {device['torch']}"
             f"{', CUDA ' + device['cuda'] if device['cuda'] else ''}; {report['elapsed_s']:.0f} s of a "
             f"{report['deadline_s']:.0f} s deadline", ""]
    if report["skipped_for_deadline"]:
        lines += [f"Skipped for the global deadline: {', '.join(report['skipped_for_deadline'])}", ""]
    lines += ["### Checks", "", "| check | status | largest error | tolerance | s |", "|---|---|---|---|---|"]
    for check in report["checks"]:
        rows = check.get("rows", [])
        worst = max(rows, key=lambda r: r["error"] / r["tolerance"]) if rows else None
        lines.append(f"| {check['name']} | {check['status']} | {_fmt(worst['error'] if worst else None, 3)} | "
                     f"{_fmt(worst['tolerance'] if worst else None, 3)} | {check['seconds']} |")
    for check in report["checks"]:
        note = check.get("error") or check.get("reason")
        if check["name"] == "two_ranks" and "backend" in check:
            note = (f"backend {check['backend']}"
                    + ("" if check["nccl_on_one_device"] else f" (NCCL refused two ranks on one device: "
                                                             f"{check['nccl_error']})" if check["nccl_error"] else ""))
        if check["name"] == "attention_backends" and "selected" in check:
            note = "selected " + ", ".join(f"{dtype}: {name}" for dtype, name in check["selected"].items()) + (
                "; not run: " + ", ".join(check["unavailable"]) if check["unavailable"] else "")
        if note:
            lines.append(f"- {check['name']}: {note}")
    step = _section(report, "transformer_step")
    if step:
        lines += ["", "### Transformer forward (one pass, bf16, random weights)", "",
                  "| model | size | tokens | variant | median s | min-max s | ms/layer | TFLOP/s | of bf16 peak | "
                  "attention share | peak GiB | predicted GiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in step["rows"]:
            lines.append(f"| {r['model']} | {r['size']} | {r['tokens']} | {r['variant']} | {r['median_s']:.4f} | "
                         f"{r['min_s']:.4f}-{r['max_s']:.4f} | {r['per_layer_ms']:.2f} | {r['tflops']:.1f} | "
                         f"{_fmt(r['bf16_peak_share'], 3)} | {r['attention_share']:.2f} | {_gib(r['peak_bytes'])} | "
                         f"{_gib(r['predicted_bytes'])} |")
    quantized = _section(report, "quantized_step")
    if quantized:
        lines += ["", f"### Kept quantized weights ({quantized['model_layers']} layers, {quantized['size']})", "",
                  "| weights | median s | min-max s | vs bf16 | weight GiB |", "|---|---|---|---|---|"]
        lines += [f"| {r['weights']} | {r['median_s']:.4f} | {r['min_s']:.4f}-{r['max_s']:.4f} | {r['vs_bf16']:.3f} | "
                  f"{_gib(r['weight_bytes'])} |" for r in quantized["rows"]]
    loads = _section(report, "load_time")
    if loads:
        lines += ["", f"### Loading a diffusers folder ({loads['model']}, bf16) onto the device", "",
                  "| loader | median s | min-max s |", "|---|---|---|"]
        lines += [f"| {r['loader']} | {r['median_s']:.3f} | {r['min_s']:.3f}-{r['max_s']:.3f} |" for r in loads["rows"]]
    compiled = _section(report, "torch_compile")
    if compiled:
        lines += ["", f"### torch.compile ({compiled['model']}, {compiled['size']}, {compiled['backend']}): compile "
                      f"{compiled['compile_s']:.1f} s, compiled / eager {compiled['compiled_vs_eager']:.3f}"]
    vae = _section(report, "vae_decode_time")
    if vae:
        lines += ["", f"### VAE decode: {vae['vae']} {vae['dtype']}, {vae['video']}: {vae['median_s']:.3f} s "
                      f"({vae['per_frame_s'] * 1000:.1f} ms per frame), peak {_gib(vae['peak_bytes'])} GiB"]
    lines += ["", "### Targets", "", "| target | bar | value | result |", "|---|---|---|---|"]
    lines += [f"| {t['name']} | {t['target']} | {_fmt(t['value'], 3)} | {t['result']}"
              f"{' (' + t['note'] + ')' if t['note'] else ''} |" for t in report["targets"]]
    errors = [e for e in report["checks"] + report["measurements"] if e["status"] == "error"]
    if errors:
        lines += ["", "### Errors", ""] + [f"- {e['name']}: {e['error']}" for e in errors]
    return "\n".join(lines) + "\n"


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _device_info(device: torch.device) -> dict:
    info = {"type": device.type, "torch": torch.__version__, "cuda": torch.version.cuda, "name": "CPU",
            "python": sys.version.split()[0]}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(name=properties.name, capability=list(torch.cuda.get_device_capability(device)),
                    memory_bytes=properties.total_memory, bf16_peak_tflops=bf16_peak_tflops(device))
    for package in ("diffusers", "gguf", "transformers", "flash_attn", "av"):
        try:
            from importlib.metadata import version

            info[package] = version(package.replace("_", "-"))
        except Exception:  # noqa: BLE001 - not installed
            info[package] = None
    return info


CHECKS = (("cuda_tests", 90, check_cuda_tests), ("world1_vs_cpu", 75, check_world1_vs_cpu),
          ("attention_backends", 30, check_attention_backends), ("quantized_layers", 30, check_quantized_layers),
          ("vae_decode", 40, check_vae_decode), ("two_ranks", 90, check_two_ranks),
          ("half_precision_sampling", 60, check_half_precision_sampling))
MEASUREMENTS = (("transformer_step", 150, measure_transformer_step), ("quantized_step", 60, measure_quantized_step),
                ("load_time", 30, measure_load), ("vae_decode_time", 40, measure_vae_decode),
                ("torch_compile", 100, measure_compile))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="run every section on the CPU at the smallest sizes "
                        "(what CI runs; its numbers say nothing about a GPU)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/gpu-check"), help="folder for gpu_report.json "
                        "and gpu_report.md (default bench-out/gpu-check; tests/gpu/run.sh passes $OUT when set)")
    parser.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                        help=f"seconds after which no section starts (default {DEFAULT_DEADLINE_S:.0f})")
    parser.add_argument("--only", help="comma-separated section names to run (default: all)")


def run(args: argparse.Namespace) -> int:
    if not args.dry_run and not torch.cuda.is_available():
        print("wanmesh bench gpu: no CUDA device is visible; run on a machine with a GPU, or pass --dry-run",
              file=sys.stderr)
        return EXIT_NO_CUDA
    if args.deadline <= 0:
        raise ValueError(f"--deadline must be positive seconds, got {args.deadline}")
    sections = CHECKS + MEASUREMENTS
    only = None if not args.only else {name.strip() for name in args.only.split(",") if name.strip()}
    if only and only - {name for name, _, _ in sections}:
        raise ValueError(f"--only {args.only!r}: valid sections are {', '.join(name for name, _, _ in sections)}")
    device = torch.device("cpu" if args.dry_run else "cuda")
    start = time.monotonic()
    report = {"version": 1, "mode": "dry-run" if args.dry_run else "gpu", "date": datetime.datetime.now(
        datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": _commit(), "device": _device_info(device),
        "deadline_s": args.deadline, "tolerances": {"fp32": FP32_TOLERANCE, "bf16": BF16_TOLERANCE,
                                                    "attention": {str(k): v for k, v in ATTENTION_TOLERANCE.items()},
                                                    "parallel_fp32": PARALLEL_TOLERANCE},
        "checks": [], "measurements": [], "skipped_for_deadline": [], "targets": []}
    with tempfile.TemporaryDirectory(prefix="wanmesh-gpu-check-") as work:
        state = Run(device, args.dry_run, _dry_run_sizes() if args.dry_run else GPU_SIZES, start + args.deadline,
                    Path(work), report)
        for kind, table in (("checks", CHECKS), ("measurements", MEASUREMENTS)):
            for name, budget, function in table:
                if only is None or name in only:
                    run_section(state, kind, name, budget, function)
    report["targets"] = evaluate_targets(report, args.dry_run)
    report["elapsed_s"] = round(time.monotonic() - start, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_report.json").write_text(json.dumps(report, indent=2, default=str))
    text = markdown(report)
    (args.out / "gpu_report.md").write_text(text)
    print(text)
    print(f"[gpu check] report: {args.out / 'gpu_report.json'}, {args.out / 'gpu_report.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wanmesh bench gpu", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as error:
        print(f"wanmesh bench gpu: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
