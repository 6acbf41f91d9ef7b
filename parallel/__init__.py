"""WanMesh engine: model loading, sampling, VAE, and the worker pool. Never imports ComfyUI."""
