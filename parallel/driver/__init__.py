"""The driver side of the pool; runs in the ComfyUI or CLI process: the pool, its local and Ray backends,
and the PoolRunner the nodes and the command line call."""
