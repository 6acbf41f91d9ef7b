"""The GPU check's harness, in the CLI process (`wanmesh bench gpu`): the sizes a run checks and measures at (the
GPU's, or the dry run's smallest), the tolerances, one section's run under its own time budget and the global
deadline, and the model files and inputs the sections share."""

from __future__ import annotations

import contextlib
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..releases import WAN_1_3B, WAN_14B, WAN_14B_LAYERS

REPO_ROOT = Path(__file__).resolve().parents[3]
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


def dry_run_sizes() -> Sizes:
    from ...tiny.models import TINY_TRANSFORMER

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


def verdict(rows: list[dict]) -> dict:
    """A check passes when every row is within its tolerance."""
    return {"status": "pass" if rows and all(row["ok"] for row in rows) else "fail", "rows": rows}


def result_row(what: str, error: float, tolerance: float, **extra) -> dict:
    return {"what": what, "error": error, "tolerance": tolerance, "ok": bool(error <= tolerance), **extra}


@contextlib.contextmanager
def no_tf32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


# -- model files ------------------------------------------------------------------------------------------------


def _transformer_state(model: torch.nn.Module, config: dict) -> dict[str, torch.Tensor]:
    from ...tiny.models import original_state_dict, original_transformer_names
    from ...weights.loaders import convert_wan_transformer_keys

    return original_state_dict(model, original_transformer_names(config), convert_wan_transformer_keys)


def write_transformer(run: Run, preset: str) -> dict[str, Path]:
    """The preset's T2V transformer as files (tiny: fp32; medium: bf16, scaled fp8, Q8_0 and Q4_K GGUF, as
    ``make-tiny --preset medium`` writes them); written once per run."""
    from gguf import GGMLQuantizationType as Q

    from ...tensor_files import save_tensors_atomic
    from ...tiny.fp8_write import write_fp8_file
    from ...tiny.gguf_write import write_wan_gguf
    from ...tiny.models import (
        MEDIUM_TRANSFORMER,
        SEED,
        TINY_TRANSFORMER,
        build_medium_transformer,
        randomise_,
    )

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


def model_inputs(model_config, latent_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    from ...config import TEXT_TOKENS

    generator = torch.Generator().manual_seed(3)
    return {"hidden_states": torch.randn(latent_shape, generator=generator),
            "encoder_hidden_states": torch.randn(1, TEXT_TOKENS, model_config.text_dim, generator=generator),
            "timestep": torch.tensor([500.0])}


def forward_on(model: torch.nn.Module, inputs: dict[str, torch.Tensor], device, dtype) -> torch.Tensor:
    moved = {key: value.to(device, dtype if value.is_floating_point() and key != "timestep" else value.dtype)
             for key, value in inputs.items()}
    with torch.no_grad():
        return model(**moved, return_dict=False)[0].float().cpu()
