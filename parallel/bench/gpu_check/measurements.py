"""The GPU check's measurements, in the CLI process (`wanmesh bench gpu`): transformer step time, peak memory
against the cost model, achieved TFLOP/s against the device's bf16 peak, kept fp8 / Q4_K against bf16, load time,
torch.compile and VAE decode time; one warm-up call each and interleaved rounds (median, fastest, slowest)."""

from __future__ import annotations

import copy
import math
import time
from typing import Callable

import torch

from ..common import Timing, time_interleaved
from .harness import BF16_PEAK_TFLOPS, Run, relative_error


def bf16_peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_TFLOPS if key in name), None)


def latent_of(size: tuple[int, int, int]) -> tuple[int, int, int, int, int]:
    from ...config import latent_shape

    return tuple(latent_shape(*size))


def _model_cost(config: dict, weight_bytes: int):
    from ...auto_layout import ModelCost

    return ModelCost(layers=config["num_layers"], heads=config["num_attention_heads"],
                     head_dim=config["attention_head_dim"], ffn_dim=config["ffn_dim"], weight_bytes=weight_bytes,
                     patch=tuple(config["patch_size"]))


def forward_flops(config: dict, tokens: int) -> float:
    """One forward pass's FLOPs, from the cost model's per-block count."""
    from ...auto_layout import block_flops

    linear, attention = block_flops(_model_cost(config, 0), tokens)
    return config["num_layers"] * (linear + attention)


def predicted_bytes(config: dict, tokens: int, weight_bytes: int) -> int:
    """The cost model's memory on one rank: the weights plus one block's activations (bf16)."""
    from ...auto_layout import activation_bytes

    return weight_bytes + activation_bytes(1, tokens, config["num_attention_heads"] * config["attention_head_dim"], 2)


def _random_model(config: dict, device: torch.device) -> torch.nn.Module:
    """Random weights in bf16, the modules diffusers keeps in float32 kept so, as WanMesh's loader and diffusers'
    ``from_pretrained`` both do."""
    from diffusers import WanTransformer3DModel

    from ...weights.checkpoint import _keeps_float32

    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(**config)
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    for name, parameter in model.named_parameters():
        parameter.data = parameter.data.to(torch.float32 if _keeps_float32(name, keep) else torch.bfloat16)
    return model.eval().requires_grad_(False)


def _step_inputs(config: dict, size: tuple[int, int, int], device) -> dict[str, torch.Tensor]:
    from ...config import TEXT_TOKENS

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
    from ...distributed.context_parallel import ContextParallel, context_parallel_plan

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
    from ...distributed.attention import attention, select_backend
    from ...networks.wan_inputs import with_native_inputs

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

    from ...tiny.models import MEDIUM_TRANSFORMER, TINY_TRANSFORMER, randomise_
    from ...weights.loaders import load_transformer

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

    from ...tiny.gguf_write import quantize
    from ...weights.quantized import FP8, StoredTensor, hold_stored_, keeps_quantized

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
    from ...networks.wan_inputs import with_native_inputs

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

    from ...tiny.models import TINY_VAE

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
