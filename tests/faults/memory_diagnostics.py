"""A diagnostic op the memory tests inject into their workers: what the rank's resident models take."""

from wanmesh.parallel.protocol import DiagnosticResult


def residency(ctx, args, tensors):
    executor = ctx.executor
    return DiagnosticResult(info={"rank": ctx.rank, "bytes": executor.resident_bytes(), "budget": executor.budget_bytes,
                                  "loaded": executor.loaded(), "evictions": list(executor.evictions)})


DIAGNOSTICS = {"residency": residency}
