"""The released Wan transformers' shapes (diffusers config fields), the one place the benchmarks take them from;
imported by the benchmarks in the CLI process and their ranks. Numbers from the released checkpoints' configs."""

from __future__ import annotations

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6)
WAN_14B = dict(WAN_1_3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)  # Wan 2.1 14B, each Wan 2.2 A14B expert
WAN_14B_LAYERS = WAN_14B["num_layers"]
WAN_TI2V_5B = dict(WAN_1_3B, num_attention_heads=24, ffn_dim=14336, in_channels=48, out_channels=48)  # Wan 2.2 TI2V
WAN_VACE_1_3B = dict(WAN_1_3B, vace_layers=list(range(0, 30, 2)), vace_in_channels=96)  # Wan2.1-VACE-1.3B
WAN_VACE_14B = dict(WAN_14B, vace_layers=list(range(0, 40, 5)), vace_in_channels=96)  # Wan2.1-VACE-14B

RELEASES = {  # bench real-size's names
    "wan21-1.3b": WAN_1_3B, "wan21-14b": WAN_14B, "wan22-a14b-expert": WAN_14B, "wan22-ti2v-5b": WAN_TI2V_5B,
    "wan21-vace-14b": WAN_VACE_14B,
}
