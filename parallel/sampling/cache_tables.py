"""The published numbers of the step-cache methods for Wan, and which released model a transformer is; plain data.

TeaCache's rescaling polynomials (highest power first) for Wan 2.1 in its "ret steps" form, fitted on the relative L1
change of the timestep projection (diffusers' ``timestep_proj``, Wan's ``e0``); the published Wan 2.2 adaptations
(A14B and TI2V 5B) use the Wan 2.1 14B polynomial. MagCache's mean magnitude ratios of consecutive residuals for 50
steps, conditional and unconditional pass per step (the first step's padding of 1.0 left out); other step counts
take the nearest entries. Shapes say which model a transformer is: hidden size, block count and input channels
(a checkpoint carries no model name). Read in the workers by ``step_cache.py``.
"""

from __future__ import annotations

TEACACHE_POLYNOMIALS = {
    "wan2.1_t2v_1.3b": (-5.21862437e+04, 9.23041404e+03, -5.28275948e+02, 1.36987616e+01, -4.99875664e-02),
    "wan2.1_t2v_14b": (-3.03318725e+05, 4.90537029e+04, -2.65530556e+03, 5.87365115e+01, -3.15583525e-01),
    "wan2.1_i2v_14b_480p": (2.57151496e+05, -3.54229917e+04, 1.40286849e+03, -1.35890334e+01, 1.32517977e-01),
    "wan2.1_i2v_14b_720p": (8.10705460e+03, 2.13393892e+03, -3.72934672e+02, 1.66203073e+01, -4.17769401e-02),
}
TEACACHE_POLYNOMIALS["wan2.2_a14b"] = TEACACHE_POLYNOMIALS["wan2.1_t2v_14b"]
TEACACHE_POLYNOMIALS["wan2.2_ti2v_5b"] = TEACACHE_POLYNOMIALS["wan2.1_t2v_14b"]

# (conditional, unconditional) interleaved, steps 2..50 of a 50-step run
MAGCACHE_RATIOS = {
    "wan2.1_t2v_1.3b": (
        1.0124, 1.02213, 1.00166, 1.0041, 0.99791, 1.00061, 0.99682, 0.99762, 0.99634, 0.99685, 0.99567, 0.99586,
        0.99416, 0.99422, 0.99578, 0.99575, 0.9957, 0.99563, 0.99511, 0.99506, 0.99535, 0.99531, 0.99552, 0.99549,
        0.99541, 0.99539, 0.9954, 0.99536, 0.99489, 0.99485, 0.99518, 0.99514, 0.99484, 0.99478, 0.99481, 0.99479,
        0.99415, 0.99413, 0.99419, 0.99416, 0.99396, 0.99393, 0.99388, 0.99386, 0.99349, 0.99349, 0.99309, 0.99304,
        0.9927, 0.9927, 0.99228, 0.99226, 0.99171, 0.9917, 0.99137, 0.99135, 0.99068, 0.99063, 0.99005, 0.99003,
        0.98944, 0.98942, 0.98849, 0.98849, 0.98758, 0.98757, 0.98644, 0.98643, 0.98504, 0.98503, 0.9836, 0.98359,
        0.98202, 0.98201, 0.97977, 0.97978, 0.97717, 0.97718, 0.9741, 0.97411, 0.97003, 0.97002, 0.96538, 0.96541,
        0.9593, 0.95933, 0.95086, 0.95089, 0.94013, 0.94019, 0.92402, 0.92414, 0.90241, 0.9026, 0.86821, 0.86868,
        0.81838, 0.81939),
    "wan2.1_t2v_14b": (
        1.02504, 1.03017, 1.00025, 1.00251, 0.9985, 0.99962, 0.99779, 0.99771, 0.9966, 0.99658, 0.99482, 0.99476,
        0.99467, 0.99451, 0.99664, 0.99656, 0.99434, 0.99431, 0.99533, 0.99545, 0.99468, 0.99465, 0.99438, 0.99434,
        0.99516, 0.99517, 0.99384, 0.9938, 0.99404, 0.99401, 0.99517, 0.99516, 0.99409, 0.99408, 0.99428, 0.99426,
        0.99347, 0.99343, 0.99418, 0.99416, 0.99271, 0.99269, 0.99313, 0.99311, 0.99215, 0.99215, 0.99218, 0.99215,
        0.99216, 0.99217, 0.99163, 0.99161, 0.99138, 0.99135, 0.98982, 0.9898, 0.98996, 0.98995, 0.9887, 0.98866,
        0.98772, 0.9877, 0.98767, 0.98765, 0.98573, 0.9857, 0.98501, 0.98498, 0.9838, 0.98376, 0.98177, 0.98173,
        0.98037, 0.98035, 0.97678, 0.97677, 0.97546, 0.97543, 0.97184, 0.97183, 0.96711, 0.96708, 0.96349, 0.96345,
        0.95629, 0.95625, 0.94926, 0.94929, 0.93964, 0.93961, 0.92511, 0.92504, 0.90693, 0.90678, 0.8796, 0.87945,
        0.86111, 0.86189),
}

HD_TOKENS = 720 * 1280 // (16 * 16)  # latent tokens per frame from which the 720p image-to-video numbers apply


def wan_variant(config, tokens_per_frame: int) -> str | None:
    """The released Wan model a transformer config is (a key of the tables above), or None for another shape (the
    tiny test models, a new variant)."""
    dim = config.num_attention_heads * config.attention_head_dim
    layers, in_channels = config.num_layers, config.in_channels
    if (dim, layers, in_channels) == (1536, 30, 16):
        return "wan2.1_t2v_1.3b"
    if (dim, layers) == (3072, 30) and config.out_channels == 48:
        return "wan2.2_ti2v_5b"
    if (dim, layers) != (5120, 40):
        return None
    if in_channels == 16:
        return "wan2.1_t2v_14b"  # Wan 2.2 T2V A14B experts have the same shape and take the same polynomial
    if getattr(config, "image_dim", None):
        return "wan2.1_i2v_14b_720p" if tokens_per_frame >= HD_TOKENS else "wan2.1_i2v_14b_480p"
    return "wan2.2_a14b"
