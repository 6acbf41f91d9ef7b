"""The GPU check's sampling section: a rank's whole sampling path in the GPU's dtypes; runs in the check's process.

``check_half_precision_sampling`` loads the tiny T2V in fp32, bf16 and fp16 into one rank's executor on the run's
device (``worker/executors.RankExecutor``: what every worker runs) and samples through both sampling loops (a
ComfyUI sampler, ``uni_pc``, and ``wan_unipc``) and one native-MODEL call (``ModelForward``), each half-precision
result against the fp32 one. Unlike the forward checks, nothing here casts the inputs for the model: a dtype that
does not reach every input fails the section, as it would fail a user's first step (``--dry-run`` in CI runs it
on the CPU).
"""

from __future__ import annotations

import torch

# Relative errors (vector norm) of a 2-step sample against fp32; measured on the CPU: bf16 0.5-1.5e-2, fp16 1e-3.
HALF_TOLERANCE = {"bf16": 6e-2, "fp16": 1e-2}
LATENT = (1, 16, 2, 8, 8)
TEXT_TOKENS, TEXT_DIM = 9, 64  # the tiny T2V's text embedding width


def _requests(handle: str) -> dict:
    from ...protocol import ModelForward, SampleRequest

    generator = torch.Generator().manual_seed(3)
    positive, negative = (torch.randn(TEXT_TOKENS, TEXT_DIM, generator=generator) for _ in range(2))
    sample = dict(handle=handle, latent=torch.zeros(LATENT), positive=[positive], negative=[negative], seed=5,
                  steps=2, guidance_scale=4.0, shift=3.0)
    forward = ModelForward(handle=handle, latent=torch.randn((2, *LATENT[1:]), generator=generator),
                           timestep=torch.tensor([600.0, 600.0]), context=torch.stack([positive, negative]))
    return {"sample uni_pc": SampleRequest(**sample, sampler="uni_pc"),
            "sample wan_unipc": SampleRequest(**sample, sampler="wan_unipc"), "model call": forward}


def _results(engine, path: str, dtype: str) -> dict[str, torch.Tensor]:
    handle = engine.load_model(path, dtype=dtype)
    try:
        return {what: (engine.forward(request) if what == "model call" else engine.sample(request))
                for what, request in _requests(handle).items()}
    finally:
        engine.unload(handle)


def check_half_precision_sampling(run) -> dict:
    from ...worker.executors import RankExecutor
    from .harness import no_tf32, relative_error, result_row, verdict, write_transformer

    path = str(write_transformer(run, "tiny")["model"])
    engine = RankExecutor(run.device)
    with no_tf32():
        reference = _results(engine, path, "fp32")
        rows = []
        for dtype, tolerance in HALF_TOLERANCE.items():
            for what, value in _results(engine, path, dtype).items():
                rows.append(result_row(f"{what} {dtype}", relative_error(value, reference[what]), tolerance,
                                       finite=bool(torch.isfinite(value).all())))
                rows[-1]["ok"] = rows[-1]["ok"] and rows[-1]["finite"]
    return verdict(rows)
