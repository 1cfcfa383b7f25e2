"""A Llama-architecture causal LM over a flat batch of tokens and a paged KV cache."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from splitspec.model.config import LlamaConfig
from splitspec.model.layers import AttentionContext, LlamaDecoderLayer, RMSNorm


class LlamaOutput(NamedTuple):
    hidden: torch.Tensor        # [T, H] after the final norm
    aux: torch.Tensor | None    # [T, len(capture) * H]: captured layer inputs, concatenated


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names match Hugging Face's LlamaForCausalLM, so checkpoints load as they are."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                capture: tuple[int, ...] = ()) -> LlamaOutput:
        """Run the decoder over input_ids [T] at positions [T].

        ``capture`` lists layer indices whose *input* (the residual stream before
        that layer) is returned in ``aux``; index num_layers means the output of
        the last layer before the final norm.
        """
        h = self.model.embed_tokens(input_ids)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in capture:
                captured[i] = h
            h = layer(h, positions, ctx)
        if self.config.num_layers in capture:
            captured[self.config.num_layers] = h
        aux = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return LlamaOutput(self.model.norm(h), aux)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] in float32 for normed hidden states [N, H]."""
        return self.lm_head(hidden).float()
