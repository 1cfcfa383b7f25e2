"""The EAGLE-3 draft head (SGLang / vLLM / SpecForge checkpoint layout).

Per token the head reads the token's embedding and a hidden state: for tokens
the target committed, ``fc`` fuses the target's three captured features
[T, 3 * H_target] into H; for tokens the head drafted itself, its own previous
output ``g`` (already H wide) is used. One decoder layer attends over
[input_layernorm(embedding) ‖ hidden_norm(hidden)] (2H wide), and returns
``g`` (the pre-norm residual stream, fed to the next drafting step) and
draft-vocabulary logits from ``lm_head(norm(g))``; ``d2t`` maps draft ids to
target ids.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch
from torch import nn

from splitspec.kernels import Fp8Weight, top_logprobs_torch
from splitspec.model.config import Eagle3Config
from splitspec.model.layers import (
    AttentionContext,
    LlamaAttention,
    LlamaMLP,
    RMSNorm,
    linear_of,
)


class Eagle3Output(NamedTuple):
    logits: torch.Tensor  # [T, draft_vocab] float32
    g: torch.Tensor       # [T, H] residual stream, the hidden input of the next step


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        layer = cfg.layer
        self.input_layernorm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.hidden_norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.self_attn = LlamaAttention(layer, in_features=2 * layer.hidden_size)
        self.post_attention_layernorm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.mlp = LlamaMLP(layer)

    def forward(self, x: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        """x [T, 2H]: the layer's input (:meth:`Eagle3Head.layer_input`); hidden [T, H]."""
        attn = self.self_attn(x, positions, 0, ctx)
        x, h = self.post_attention_layernorm.add_forward(attn, hidden)
        return h + self.mlp(x)


class Eagle3Head(nn.Module):
    kernels: ModuleType | None = None  # set by use_fused_kernels (fc's and lm_head's projections)

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        layer = cfg.layer
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, layer.hidden_size, bias=False)
        self.embed_tokens = nn.Embedding(layer.vocab_size, layer.hidden_size)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.lm_head = nn.Linear(layer.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(layer.vocab_size, dtype=torch.bool))
        self.fp8: dict[str, Fp8Weight] = {}  # fc and lm_head, when quantize_projections ran

    def projection_weights(self) -> dict[str, torch.Tensor]:
        """Its own projections' weights (its layer's are the layer's), for quantize_projections."""
        return {"fc": self.fc.weight, "lm_head": self.lm_head.weight}

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [T, 3 * H_target] -> hidden [T, H]."""
        return linear_of(self.kernels)(features.to(self.fc.weight.dtype),
                                       self.fp8.get("fc", self.fc.weight))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """The head's residual stream [T, H] -> draft-vocabulary logits [T, V_draft], float32."""
        return self._lm_head(g).float()

    def top_logprobs(self, g: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k likeliest draft tokens of each row of g [T, H]: log-probabilities [T, k]
        (float32, descending) and draft ids [T, k]. With the kernels on, through
        splitspec.kernels.top_logprobs (its two Triton kernels, reading the projection's
        output as it is, while ``ROUTED`` is set, as it is by default)."""
        logits = self._lm_head(g)
        if self.kernels is None:
            return top_logprobs_torch(logits, k)
        return self.kernels.top_logprobs(logits, k)

    def _lm_head(self, g: torch.Tensor) -> torch.Tensor:
        return linear_of(self.kernels)(self.norm(g), self.fp8.get("lm_head", self.lm_head.weight))

    def layer_input(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[input_layernorm(embed(input_ids)) ‖ hidden_norm(hidden)]: [T, 2H]; with the
        kernels on, in one kernel (the gather, both norms and the concatenation)."""
        layer = self.midlayer
        embed, own = layer.input_layernorm, layer.hidden_norm
        if self.kernels is not None:
            return self.kernels.embed_norm_pair(input_ids, self.embed_tokens.weight, hidden,
                                                embed.weight, own.weight, embed.eps, own.eps)
        return torch.cat((embed(self.embed_tokens(input_ids)), own(hidden)), dim=-1)

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             ctx: AttentionContext) -> torch.Tensor:
        """The residual stream g [T, H] after the layer; input_ids [T]; hidden [T, H]: fused
        target features or the head's own g."""
        return self.midlayer(self.layer_input(input_ids, hidden), hidden, positions, ctx)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                ctx: AttentionContext) -> Eagle3Output:
        """input_ids [T]; hidden [T, H]: fused target features or the head's own g."""
        g = self.step(input_ids, hidden, positions, ctx)
        return Eagle3Output(self.logits(g), g)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
