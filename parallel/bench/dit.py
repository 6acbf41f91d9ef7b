"""`wanmesh bench dit`: one denoise step of WanMesh against diffusers' own transformer forward, same weights and shapes;
runs in the CLI process.

WanMesh's step is what the sampler runs (CFG: two model passes, the guidance mix and the scheduler update);
diffusers' reference is its WanTransformer3DModel called twice on the same inputs. The ratio shows what
WanMesh adds or saves around the transformer.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

WAN_1_3B = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6,
)


def add_arguments(parser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument("--shape", choices=["tiny", "1.3b"], default="tiny",
                        help="tiny: the built-in tiny model at 128x96, 17 frames; 1.3b: Wan 1.3B, 832x480, 81 frames")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", type=Path, help="tiny models tree (default: the cache folder)")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _tiny_models(args, device):
    from ..models.tiny_files import TINY_FILES, ensure_tiny_models, tiny_cache_dir
    from ..models.wan import load_transformer

    root = ensure_tiny_models(args.models or tiny_cache_dir())
    ours = load_transformer(str(root / TINY_FILES["model"]), device=device)
    reference = load_transformer(str(root / "diffusers" / "wan_tiny_t2v"), device=device)
    return ours, reference, (1, 16, 5, 12, 16), torch.float32


def _wan_1_3b(device):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**WAN_1_3B).to(device=device, dtype=torch.bfloat16).eval()
    return model, model, (1, 16, 21, 60, 104), torch.bfloat16


def run(args) -> int:
    from ..sampling.guidance import guided_prediction
    from ..sampling.loop import make_scheduler

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.shape == "1.3b" and device.type != "cuda":
        raise SystemExit("--shape 1.3b needs a CUDA device (about 20 GB); use --shape tiny on the CPU")
    ours, reference, shape, dtype = _tiny_models(args, device) if args.shape == "tiny" else _wan_1_3b(device)
    generator = torch.Generator("cpu").manual_seed(0)
    latents = torch.randn(shape, generator=generator).to(device)
    context = torch.randn(2, 512, ours.config.text_dim, generator=generator).to(device, dtype)
    positive, negative = context[:1], context[1:]
    scheduler = make_scheduler("euler", 5.0)
    scheduler.set_timesteps(1000, device="cpu")
    t = scheduler.timesteps[500]

    def wanmesh_step():
        scheduler._step_index = 500  # the same step every repeat
        prediction = guided_prediction(ours, latents.to(dtype), t, positive, negative, 5.0, {})
        scheduler.step(prediction.float(), t, latents, return_dict=False)

    def diffusers_forward():
        timestep = t.expand(1).to(device)
        for ctx in (positive, negative):
            reference(hidden_states=latents.to(dtype), timestep=timestep, encoder_hidden_states=ctx, return_dict=False)

    with torch.no_grad():
        ours_s = _time(wanmesh_step, device, args.repeats)
        ref_s = _time(diffusers_forward, device, args.repeats)
    tokens = shape[2] * shape[3] * shape[4] // 4
    print(f"bench dit: shape {args.shape} {list(shape)} ({tokens} tokens), {dtype}, {device}, CFG on (2 passes)")
    print(f"{'what':<40}{'s/step':>12}")
    print(f"{'WanMesh denoise step':<40}{ours_s:>12.4f}")
    print(f"{'diffusers transformer forward x2':<40}{ref_s:>12.4f}")
    print(f"{'ratio WanMesh / diffusers':<40}{ours_s / ref_s:>12.3f}")
    return 0
