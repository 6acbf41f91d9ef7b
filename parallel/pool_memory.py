"""Giving memory back on request (ComfyUI's "unload models" / "free memory"); runs in the driver process.

Neither action starts a pool: with no live pool they do nothing.
"""

from __future__ import annotations

from .driver.pool import close_cached_pool, current_pool


def unload_pool_models() -> bool:
    """Unload every resident model of the live pool and give its workers' memory back: the workers are replaced
    by fresh ones with the same settings, since a worker keeps what it imported for its models (about 200 MiB of
    model code per process) and, on GPUs, its context, which no unload returns. A handle a node still holds is
    loaded again when it is next used. True when a running pool was asked."""
    pool = current_pool()
    if pool is None or not pool.running:
        return False
    pool.recycle()  # the old workers exit with their models; the pool loads them again when next named
    return True


def stop_pool() -> bool:
    """Stop the live pool's workers (they exit); the next use starts a fresh pool. True when one was live."""
    live = current_pool() is not None
    close_cached_pool()
    return live
