"""The VACE transformer with several VACE contexts; runs in the workers.

ComfyUI's native VACE conditioning can carry several contexts (chained ``WanVaceToVideo`` nodes), each with
its own strength: every context runs through the VACE blocks on its own and its hints are added to the main
blocks scaled by its strength. diffusers' ``WanVACETransformer3DModel`` takes exactly one context, so this
subclass keeps diffusers' forward for one context ``[B, 96, T, h, w]`` and, for ``[B, N, 96, T, h, w]``,
runs the same submodules once per context (written here because no library does it). It calls the same
submodules as diffusers' forward, so the tensor- and context-parallel plans apply unchanged.
"""

from __future__ import annotations

import torch
from diffusers import WanVACETransformer3DModel


class WanVaceMultiContext(WanVACETransformer3DModel):
    """``control_hidden_states`` ``[B, N, 96, T, h, w]`` with ``control_hidden_states_scale`` ``[N]``: one
    strength per context. One context (``[B, 96, T, h, w]``, a scale per VACE layer) is diffusers' forward."""

    def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None,
                control_hidden_states=None, control_hidden_states_scale=None, return_dict=True, attention_kwargs=None):
        if control_hidden_states is None or control_hidden_states.ndim == 5:
            return super().forward(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image,
                                   control_hidden_states, control_hidden_states_scale, return_dict, attention_kwargs)
        output = self._forward_contexts(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image,
                                        control_hidden_states, control_hidden_states_scale)
        return (output,) if not return_dict else {"sample": output}

    def _forward_contexts(self, latents, timestep, text, image, contexts, strengths):
        if contexts.shape[1] != strengths.numel():
            raise ValueError(f"{contexts.shape[1]} VACE contexts but {strengths.numel()} strengths")
        rotary_emb = self.rope(latents)
        tokens = self.patch_embedding(latents).flatten(2).transpose(1, 2)
        temb, timestep_proj, text, image = self.condition_embedder(timestep, text, image)
        timestep_proj = timestep_proj.unflatten(1, (6, -1))
        if image is not None:
            text = torch.concat([image, text], dim=1)
        hints = [self._context_hints(tokens, text, contexts[:, j], timestep_proj, rotary_emb)
                 for j in range(contexts.shape[1])]
        vace_layers = list(self.config.vace_layers)
        for i, block in enumerate(self.blocks):
            tokens = block(tokens, text, timestep_proj, rotary_emb)
            if i in vace_layers:
                for context_hints, strength in zip(hints, strengths):  # one context after the other, as native
                    tokens = tokens + context_hints[vace_layers.index(i)] * strength
        return self._unpatchify(self._output_projection(tokens, temb), latents.shape)

    def _context_hints(self, tokens, text, context, timestep_proj, rotary_emb) -> list[torch.Tensor]:
        """The hint of every VACE block for one context ``[B, 96, T, h, w]``."""
        control = self.vace_patch_embedding(context).flatten(2).transpose(1, 2)
        hints = []
        for block in self.vace_blocks:
            hint, control = block(tokens, text, control, timestep_proj, rotary_emb)
            hints.append(hint)
        return hints

    def _output_projection(self, tokens, temb):
        shift, scale = (self.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
        tokens = (self.norm_out(tokens.float()) * (1 + scale) + shift).type_as(tokens)
        return self.proj_out(tokens)

    def _unpatchify(self, tokens, latent_shape) -> torch.Tensor:
        batch, _, frames, height, width = latent_shape
        p_t, p_h, p_w = self.config.patch_size
        tokens = tokens.reshape(batch, frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
        return tokens.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)
