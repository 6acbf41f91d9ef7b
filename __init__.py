"""WanMesh: ComfyUI entry point. Registers the nodes; all work lives in `parallel/`.

The node mappings load on first access (PEP 562): ComfyUI reads ``NODE_CLASS_MAPPINGS`` right after importing the
pack, while a worker process, which imports this package only because its modules live under it, never loads the
nodes, ComfyUI glue or driver code (``tests/unit/test_process_boundary.py`` checks both sides).
"""

NODE_EXPORTS = ("NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS")
WEB_DIRECTORY = "./nodes/web"  # the frontend extension (the Stream Sampler's live prompt), served by ComfyUI
__all__ = [*NODE_EXPORTS, "WEB_DIRECTORY"]


def __getattr__(name: str):
    if name in NODE_EXPORTS:
        from . import nodes

        return getattr(nodes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
