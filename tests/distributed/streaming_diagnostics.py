"""A diagnostic op the block-streaming test injects into its workers: each resident model's streaming state."""

from wanmesh.parallel.protocol import DiagnosticResult


def streaming(ctx, args, tensors):
    executor = ctx.executor
    models = {handle: executor._get(handle, "model") for handle in executor.loaded() if handle.startswith("model|")}
    info = {}
    for handle, model in models.items():
        streamer = getattr(model, "block_streamer", None)
        info[handle] = None if streamer is None else {
            "bytes_moved": streamer.bytes_moved, "block_bytes": sum(streamer.block_bytes),
            "device_bytes": streamer.device_bytes, "fetched": len(streamer.fetched)}
    return DiagnosticResult(info={"rank": ctx.rank, "budget": executor.budget_bytes, "models": info})


DIAGNOSTICS = {"streaming": streaming}
