"""The GPU check's correctness sections, in the CLI process (`wanmesh bench gpu`): the CUDA-only tests, world 1
on the device against the CPU, every attention backend, quantized linears kept as stored, and the VAE decodes; each
row an error against its tolerance."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

from .harness import (
    ATTENTION_TOLERANCE,
    BF16_TOLERANCE,
    FP32_TOLERANCE,
    LSE_TOLERANCE,
    REPO_ROOT,
    Run,
    forward_on,
    model_inputs,
    no_tf32,
    relative_error,
    result_row,
    verdict,
    write_transformer,
)


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
    from ...weights.loaders import load_transformer

    rows = []
    for preset in run.sizes.presets:
        paths = write_transformer(run, preset)
        reference_model = load_transformer(str(paths["model"]), dtype=torch.float32, device="cpu")
        inputs = model_inputs(reference_model.config, run.sizes.check_latent)
        reference = forward_on(reference_model, inputs, "cpu", torch.float32)
        del reference_model
        for dtype, tolerance in ((torch.float32, FP32_TOLERANCE), (torch.bfloat16, BF16_TOLERANCE)):
            model = load_transformer(str(paths["model"]), dtype=dtype, device=run.device)
            with no_tf32():
                output = forward_on(model, inputs, run.device, dtype)
            rows.append(result_row(f"{preset} {str(dtype).removeprefix('torch.')}",
                                   relative_error(output, reference), tolerance))
            del model
        for name in ("fp8_scaled", "Q8_0", "Q4_K"):
            if name not in paths:
                continue
            cpu = load_transformer(str(paths[name]), dtype=torch.float32, device="cpu", weights="dequantize")
            expected = forward_on(cpu, inputs, "cpu", torch.float32)
            del cpu
            kept = load_transformer(str(paths[name]), dtype=torch.bfloat16, device=run.device, weights="keep")
            kept_output = forward_on(kept, inputs, run.device, torch.bfloat16)
            rows.append(result_row(f"{preset} {name} kept, bf16", relative_error(kept_output, expected),
                                   BF16_TOLERANCE))
            del kept
    return verdict(rows)


def attention_backends(device: torch.device) -> list[str]:
    """The local backends this device runs: CPU flash and math on a CPU; on CUDA flash-attn (when importable),
    PyTorch's flash, cuDNN and memory-efficient SDPA, and math."""
    from ...distributed.attention import _flash_attn_func

    if device.type != "cuda":
        return ["cpu_flash", "math"]
    return (["flash_attn"] if _flash_attn_func() is not None else []) + ["sdpa_flash", "sdpa_cudnn",
                                                                           "sdpa_efficient", "math"]


@no_tf32()  # math's einsum in float32 must not run in TF32 on the GPU
def check_attention_backends(run: Run) -> dict:
    from ...distributed.attention import attention, select_backend

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
                rows.append(result_row(f"{backend} {str(dtype).removeprefix('torch.')} key padding {padding}",
                                 relative_error(out, ref_out), ATTENTION_TOLERANCE[dtype], lse_error=lse_error,
                                 lse_tolerance=LSE_TOLERANCE[dtype]))
                rows[-1]["ok"] = rows[-1]["ok"] and lse_error <= LSE_TOLERANCE[dtype]
    selected_ran = all(any(row["what"].startswith(f"{name} {dt}") for row in rows) for dt, name in selected.items())
    result = verdict(rows)
    if not selected_ran:
        result["status"] = "fail"
    return {**result, "selected": selected, "unavailable": unavailable, "shape": list(run.sizes.attention_shape)}


def _stored_weights(weight: torch.Tensor) -> dict:
    """``weight`` [out, in] in each stored form (StoredTensor on the CPU)."""
    from gguf import GGMLQuantizationType as Q

    from ...tiny.gguf_write import quantize
    from ...weights.quantized import FP8, StoredTensor

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
    from ...weights.quantized import dequantize_stored, hold_stored_

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
            with torch.no_grad(), no_tf32():
                device_weight = layer.weight  # dequantised on the device
                output = layer(x.to(run.device, dtype))
            same_bits = bool(torch.equal(device_weight.cpu(), cpu_weight))
            rows.append(result_row(f"{name} {str(dtype).removeprefix('torch.')}", relative_error(output, expected),
                                   tolerance, weight_bit_exact=same_bits))
            rows[-1]["ok"] = rows[-1]["ok"] and same_bits
    return verdict(rows)


def _write_vaes(run: Run) -> dict[str, Path]:
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from ...tensor_files import save_tensors_atomic
    from ...tiny.models import (
        SEED,
        TINY_VAE,
        original_state_dict,
        original_vae_names,
        randomise_,
    )
    from ...tiny.vae22 import write_tiny_vae22

    vae = AutoencoderKLWan(**TINY_VAE)
    randomise_(vae, SEED + 2)
    state = original_state_dict(vae.eval(), original_vae_names(TINY_VAE), convert_wan_vae_to_diffusers)
    return {"2.1": save_tensors_atomic(state, run.work / "vae" / "wan21_tiny_vae.safetensors"),
            "2.2": write_tiny_vae22(run.work / "vae22")}


def _vae_dtypes(device: torch.device) -> tuple:
    # bf16 3D convolutions on a CPU are too slow for the dry run: float32 only there
    return ((torch.float32, FP32_TOLERANCE),) + (((torch.bfloat16, BF16_TOLERANCE),) if device.type == "cuda" else ())


def check_vae_decode(run: Run) -> dict:
    from ...weights.loaders import load_vae

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
            with torch.no_grad(), no_tf32():
                output = vae.decode(latent.to(run.device, dtype), return_dict=False)[0]
            rows.append(result_row(f"VAE {version} {str(dtype).removeprefix('torch.')}",
                                   relative_error(output, reference), tolerance, frames=int(output.shape[2])))
    return verdict(rows)
