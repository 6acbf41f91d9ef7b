"""Sampling: the denoising loop, the latent space and guidance; runs in the worker processes."""
