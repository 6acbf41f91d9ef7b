"""Giving memory back on request (ComfyUI's "unload models" / "free memory"); runs in the driver process.

Neither action starts a pool: with no live pool they do nothing.
"""

from __future__ import annotations

from .driver.pool import close_cached_pool, current_pool


def unload_pool_models() -> bool:
    """Unload every resident model of the live pool and give all its workers' memory back: the workers exit, since
    a worker keeps what it imported for its models (about 200 MiB of model code per process) and, on GPUs, its
    context, which no unload returns; the pool's next request starts fresh ones with the same settings and loads
    again the models it names. True when a running pool was asked."""
    pool = current_pool()
    if pool is None or not pool.running:
        return False
    pool.recycle()
    return True


def stop_pool() -> bool:
    """Stop the live pool's workers (they exit); the next use starts a fresh pool. True when one was live."""
    live = current_pool() is not None
    close_cached_pool()
    return live
