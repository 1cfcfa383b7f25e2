"""A Llama-architecture causal LM over a flat batch of tokens and a paged KV cache,
optionally one rank's shard of it (splitspec.model.parallel)."""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch
from torch import nn

from splitspec.kernels import Fp8Weight
from splitspec.model.config import LlamaConfig
from splitspec.model.layers import AttentionContext, LlamaDecoderLayer, RMSNorm, linear_of
from splitspec.model.parallel import SINGLE, TPGroup, VocabParallelEmbedding, layout


class LlamaOutput(NamedTuple):
    hidden: torch.Tensor        # [T, H] after the final norm
    aux: torch.Tensor | None    # [T, len(capture) * H]: captured layer inputs, concatenated


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size) if tp.size == 1
                             else VocabParallelEmbedding(cfg, tp))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names match Hugging Face's LlamaForCausalLM, so checkpoints load as they are."""

    kernels: ModuleType | None = None  # set by use_fused_kernels (lm_head's projection)

    def __init__(self, cfg: LlamaConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = LlamaModel(cfg, tp)
        start, stop = layout(cfg, tp).vocab if tp.size > 1 else (0, cfg.vocab_size)
        self.lm_head = nn.Linear(cfg.hidden_size, stop - start, bias=False)
        self.fp8: dict[str, Fp8Weight] = {}  # lm_head, when quantize_projections ran

    def projection_weights(self) -> dict[str, torch.Tensor]:
        """Its own projection's weight (lm_head), for quantize_projections (a standalone draft)."""
        return {"lm_head": self.lm_head.weight}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                capture: tuple[int, ...] = ()) -> LlamaOutput:
        """Run the decoder over input_ids [T] at positions [T].

        ``capture`` lists layer indices whose *input* (the residual stream before
        that layer) is returned in ``aux``, and stored in the cache's features at the
        new tokens' slots where it keeps them (``KVCache.hold_features``); index
        num_layers means the output of the last layer before the final norm.
        """
        h = self.model.embed_tokens(input_ids)  # the residual stream
        delta: torch.Tensor | None = None  # the last MLP's output, not yet added to h
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            norm = layer.input_layernorm
            x, h = (norm(h), h) if delta is None else norm.add_forward(delta, h)
            if i in capture:
                captured[i] = h
            delta, h = layer(x, h, positions, ctx)
        final = self.model.norm
        normed, h = (final(h), h) if delta is None else final.add_forward(delta, h)
        if self.config.num_layers in capture:
            captured[self.config.num_layers] = h
        aux = None
        if capture:
            aux = torch.cat([captured[i] for i in capture], dim=-1)
            ctx.cache.write_features(ctx.meta.write_slots, aux)
        return LlamaOutput(normed, aux)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] in float32 for normed hidden states [N, H] (on every rank)."""
        logits = linear_of(self.kernels)(hidden,
                                         self.fp8.get("lm_head", self.lm_head.weight)).float()
        if self.tp.size == 1:
            return logits
        width = layout(self.config, self.tp).vocab_shard
        logits = nn.functional.pad(logits, (0, width - logits.shape[-1]))
        return self.tp.all_gather_last(logits)[:, : self.config.vocab_size]
