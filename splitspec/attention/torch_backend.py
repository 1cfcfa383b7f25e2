"""The reference attention backend: plain torch, CPU or GPU, one sequence at a time.

Used on CPU and by the tests as the oracle for faster backends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitspec.attention.base import AttentionBackend, AttentionMetadata, SeqAttention, causal_mask
from splitspec.kv_cache import KVCache


@dataclass
class TorchMetadata(AttentionMetadata):
    qo_indptr: list[int] = field(default_factory=list)  # sequence i's queries: [qo_indptr[i], qo_indptr[i+1])
    read_slots: list[torch.Tensor] = field(default_factory=list)  # per sequence: [kv_len] global slots
    masks: list[torch.Tensor] = field(default_factory=list)       # per sequence: [q_len, kv_len] bool


class TorchAttentionBackend(AttentionBackend):
    def plan(self, seqs: list[SeqAttention], device: torch.device | str) -> TorchMetadata:
        write, read, masks, indptr = [], [], [], [0]
        for seq in seqs:
            if not 0 < seq.q_len <= seq.kv_len:
                raise ValueError(f"need 0 < q_len <= kv_len, got q_len={seq.q_len} kv_len={seq.kv_len}")
            slots = seq.table.global_slots(0, seq.kv_len, device)
            read.append(slots)
            write.append(slots[seq.kv_len - seq.q_len:])
            mask = seq.dense_mask()
            masks.append(causal_mask(seq.q_len, seq.kv_len, device) if mask is None
                         else mask.to(device=device, dtype=torch.bool))
            indptr.append(indptr[-1] + seq.q_len)
        return TorchMetadata(torch.cat(write), indptr, read, masks)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TorchMetadata, cache: KVCache) -> torch.Tensor:
        cache.write(layer, meta.write_slots, k, v)
        num_heads, head_dim = q.shape[1], q.shape[2]
        group = num_heads // k.shape[1]
        scale = head_dim ** -0.5
        out = torch.empty_like(q)
        for i, (slots, mask) in enumerate(zip(meta.read_slots, meta.masks, strict=True)):
            lo, hi = meta.qo_indptr[i], meta.qo_indptr[i + 1]
            # qi: [H, q, D]; ki, vi: [H, kv, D] (KV heads repeated for GQA)
            qi = q[lo:hi].transpose(0, 1).float()
            k_seq, v_seq = cache.read(layer, slots)  # [kv, H_kv, D]
            ki = k_seq.repeat_interleave(group, dim=1).transpose(0, 1).float()
            vi = v_seq.repeat_interleave(group, dim=1).transpose(0, 1).float()
            scores = (qi @ ki.transpose(1, 2)) * scale          # [H, q, kv]
            scores = scores.masked_fill(~mask, float("-inf"))
            out[lo:hi] = (scores.softmax(dim=-1) @ vi).transpose(0, 1).to(q.dtype)
        return out
