"""Model files and models; runs in the workers (and the CLI's make-tiny): checkpoint reading and detection,
Wan T2V/VACE transformer and VAE loading (diffusers classes), tensor-parallel sharded loading, umT5, VAE
tiling, pixel formats, and the tiny test models."""
