"""Train an EAGLE-3 head for a Llama-architecture target, with the training-time-test loss.

The head learns to continue the target from the target's own features. At
inference it drafts ``k`` steps ahead, feeding its own output ``g`` back in;
"training-time test" (TTT, EAGLE-3 §3) simulates exactly that during
training by unrolling ``ttt_steps`` steps over every position at once:

* step 0: entry i = (fc(target features of token i), embedding of token i+1)
  at rope position i, causal over step-0 entries; it predicts the target's
  distribution after token i+1.
* step j >= 1: entry i = (g of step j-1 at entry i-1, embedding of token
  i+1) at position i, as if entries < i-j+1 were committed and the head had
  drafted the rest itself. It attends to step-0 entries 0..i-j (the committed
  prefix) and to the step-s entry at i-j+s for s = 1..j (its own drafted
  ancestors and itself) — the same mask the drafter's tree uses.

Labels are the target's next-token distributions restricted to the draft
vocabulary (soft cross-entropy); step j is weighted ``decay ** j``. The
embedding is the target's and stays frozen; ``lm_head`` and ``norm`` start
from the target's. The result is written in the SGLang / vLLM layout
(``LlamaForCausalLMEagle3``) that :func:`splitspec.model.loader.load_eagle3` reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from splitspec.model.config import Eagle3Config, LlamaConfig, read_hf_config
from splitspec.model.eagle3 import Eagle3Head
from splitspec.model.layers import rotate_half
from splitspec.training.lm import lr_factor, seed_everything


@dataclass(frozen=True)
class Eagle3TrainConfig:
    steps: int
    batch_size: int
    lr: float
    ttt_steps: int = 4
    seed: int = 0
    device: str = "cpu"
    draft_vocab_size: int = 0          # 0 = the target's whole vocabulary
    head_overrides: dict[str, Any] = field(default_factory=dict)  # config.json keys of the head
    show_progress: bool = True
    decay: float = 0.8
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.5


class Eagle3TrainResult(NamedTuple):
    out_dir: Path
    final_loss: float
    step_accuracy: list[float]  # top-1 agreement with the target at each TTT step (last batches)


def head_config(target_cfg: dict[str, Any], draft_vocab_size: int,
                overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json of a head for this target (one decoder layer of the target's width)."""
    hidden = target_cfg["hidden_size"]
    heads = target_cfg["num_attention_heads"]
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": target_cfg["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": target_cfg.get("num_key_value_heads", heads),
        "head_dim": target_cfg.get("head_dim") or hidden // heads,
        "vocab_size": target_cfg["vocab_size"],
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": hidden,
        "max_position_embeddings": target_cfg.get("max_position_embeddings", 2048),
        "rope_theta": float(target_cfg.get("rope_theta")
                            or (target_cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        "rms_norm_eps": target_cfg.get("rms_norm_eps", 1e-5),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": target_cfg.get("bos_token_id"),
        "eos_token_id": target_cfg.get("eos_token_id"),
        "torch_dtype": "bfloat16",
    }
    if target_cfg.get("rope_scaling"):
        cfg["rope_scaling"] = target_cfg["rope_scaling"]
    cfg.update(overrides)
    return cfg


def choose_draft_vocab(token_counts: np.ndarray | None, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent target ids (ties by id), sorted; all ids when size is 0."""
    if size == 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    if token_counts is None:
        raise ValueError("a reduced draft vocabulary needs token counts of the corpus")
    order = np.lexsort((np.arange(vocab_size), -token_counts[:vocab_size]))
    return torch.from_numpy(np.sort(order[:size])).long()


class _TTTBatch(NamedTuple):
    features: torch.Tensor   # [B, L, 3H] target features of tokens 0..L-1
    next_ids: torch.Tensor   # [B, L] token i+1 for entry i
    labels: torch.Tensor     # [B, L, Vd] target distribution after token i+1, draft vocabulary


def _rope(x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, L, D] at positions 0..L-1."""
    pos = torch.arange(x.shape[2], device=x.device, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return x * emb.cos().to(x.dtype) + rotate_half(x) * emb.sin().to(x.dtype)


def _shift(x: torch.Tensor, by: int, dim: int) -> torch.Tensor:
    """x shifted towards higher indices along dim by `by` (zeros enter at the front)."""
    if by == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, by))
    return torch.cat((pad, x.narrow(dim, 0, x.shape[dim] - by)), dim=dim)


def ttt_forward(head: Eagle3Head, batch: _TTTBatch, num_steps: int) -> list[torch.Tensor]:
    """Draft-vocabulary logits [B, L, Vd] of every TTT step (see the module docstring)."""
    layer = head.midlayer
    attn = layer.self_attn
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    b, length, _ = batch.features.shape
    embeds = layer.input_layernorm(head.embed_tokens(batch.next_ids))
    hidden = head.fuse(batch.features)
    pos = torch.arange(length, device=hidden.device)
    causal = pos[None, :] <= pos[:, None]  # [L, L]
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    outputs = []
    for step in range(num_steps):
        x = torch.cat((embeds, layer.hidden_norm(hidden)), dim=-1)
        q = _rope(attn.q_proj(x).view(b, length, nh, hd).transpose(1, 2), attn.rotary.inv_freq)
        k = _rope(attn.k_proj(x).view(b, length, nkv, hd).transpose(1, 2), attn.rotary.inv_freq)
        v = attn.v_proj(x).view(b, length, nkv, hd).transpose(1, 2)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        keys.append((k, v))
        scale = hd ** -0.5
        k0, v0 = keys[0]
        prefix = (q @ k0.transpose(-1, -2)) * scale                       # [B, H, L, L]
        prefix = prefix.masked_fill(~_shift(causal, step, 0), float("-inf"))
        diag_scores, diag_values = [], []
        for s in range(1, step + 1):
            ks, vs = (_shift(t, step - s, 2) for t in keys[s])
            diag_scores.append(((q * ks).sum(-1) * scale)[..., None])     # [B, H, L, 1]
            diag_values.append(vs)
        # Entries i < step see no prefix (their rows of `prefix` are all masked); they are
        # left out of the loss and never feed a valid entry of a later step.
        scores = torch.cat([prefix, *diag_scores], dim=-1).float()
        probs = scores.softmax(-1).to(v0.dtype)
        out = probs[..., :length] @ v0
        for s, vs in enumerate(diag_values):
            out = out + probs[..., length + s, None] * vs
        out = attn.o_proj(out.transpose(1, 2).reshape(b, length, nh * hd))
        h = hidden + out
        g = h + layer.mlp(layer.post_attention_layernorm(h))
        outputs.append(head.lm_head(head.norm(g)))
        hidden = _shift(g, 1, 1)  # entry i of the next step continues from entry i-1 here
    return outputs


def ttt_loss(head: Eagle3Head, batch: _TTTBatch, num_steps: int, decay: float
             ) -> tuple[torch.Tensor, list[float]]:
    """Weighted soft cross-entropy over TTT steps; also top-1 agreement per step."""
    total = torch.zeros((), device=batch.features.device)
    accuracy = []
    target_top = batch.labels.argmax(-1)
    for step, logits in enumerate(ttt_forward(head, batch, num_steps)):
        valid = slice(step, None)  # entries before `step` have no committed prefix
        logp = F.log_softmax(logits[:, valid].float(), dim=-1)
        total = total + decay ** step * -(batch.labels[:, valid] * logp).sum(-1).mean()
        accuracy.append((logits[:, valid].argmax(-1) == target_top[:, valid]).float().mean().item())
    return total, accuracy


def target_features(target: torch.nn.Module, ids: torch.Tensor, capture: tuple[int, ...]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs of the captured layers ([B, T, len(capture) * H]; index N = the last layer's
    output before the final norm, as the serving target captures them) and the logits.

    Read with forward pre-hooks rather than ``output_hidden_states``, whose last entry is
    after the final norm in transformers."""
    layers = target.model.layers
    modules = {i: (layers[i] if i < len(layers) else target.model.norm) for i in capture}
    seen: dict[int, torch.Tensor] = {}
    hooks = [module.register_forward_pre_hook(
        lambda _m, args, kwargs, i=i: seen.__setitem__(i, (args or (kwargs["hidden_states"],))[0]),
        with_kwargs=True) for i, module in modules.items()]
    try:
        logits = target(ids).logits
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat([seen[i] for i in capture], dim=-1), logits


def _target_batch(target: torch.nn.Module, ids: torch.Tensor, capture: tuple[int, ...],
                  draft_ids: torch.Tensor) -> _TTTBatch:
    with torch.no_grad():
        features, logits = target_features(target, ids, capture)
        labels = F.softmax(logits[:, 1:, draft_ids].float(), dim=-1)
    return _TTTBatch(features[:, :-1].detach(), ids[:, 1:], labels)


def _init_head(cfg: dict[str, Any], target: torch.nn.Module, draft_ids: torch.Tensor,
               seed: int) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_hf(cfg))
    for param in head.parameters():
        if param.dim() == 2:
            torch.nn.init.normal_(param, std=0.02)
        else:
            torch.nn.init.ones_(param)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight.float())
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids].float())
        head.norm.weight.copy_(target.model.norm.weight.float())
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    head.embed_tokens.weight.requires_grad_(False)
    return head


def train_eagle3(target_dir: Path, train_blocks: torch.Tensor, out_dir: Path,
                 cfg: Eagle3TrainConfig, token_counts: np.ndarray | None = None) -> Eagle3TrainResult:
    """Train a head on the target's features of train_blocks [N, T] and write it to out_dir."""
    from transformers import LlamaForCausalLM  # training-only dependency

    seed_everything(cfg.seed)
    device = torch.device(cfg.device)
    target_cfg = read_hf_config(target_dir)
    layers = LlamaConfig.from_hf(target_cfg).num_layers
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    draft_ids = choose_draft_vocab(token_counts, target_cfg["vocab_size"], cfg.draft_vocab_size)
    config = head_config(target_cfg, len(draft_ids), cfg.head_overrides)
    capture = Eagle3Config.from_hf(config).aux_layer_inputs(layers)
    head = _init_head(config, target, draft_ids, cfg.seed).to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    draft_ids_dev = draft_ids.to(device)
    bar = tqdm(range(cfg.steps), desc="EAGLE-3 head", disable=not cfg.show_progress)
    loss_avg, acc_avg = None, None
    for step in bar:
        rows = torch.randint(0, train_blocks.shape[0], (cfg.batch_size,), generator=gen)
        batch = _target_batch(target, train_blocks[rows].to(device), capture, draft_ids_dev)
        for group in optim.param_groups:
            group["lr"] = cfg.lr * lr_factor(step, cfg)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, acc = ttt_loss(head, batch, cfg.ttt_steps, cfg.decay)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optim.step()
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        acc_avg = acc if acc_avg is None else [0.95 * a + 0.05 * b for a, b in zip(acc_avg, acc,
                                                                                  strict=True)]
        bar.set_postfix(loss=f"{loss_avg:.3f}", acc=" ".join(f"{a:.2f}" for a in acc_avg))
    save_head(head, config, out_dir)
    return Eagle3TrainResult(out_dir, float(loss_avg or 0.0), list(acc_avg or []))


def evaluate_eagle3(head_dir: Path, target_dir: Path, blocks: torch.Tensor, ttt_steps: int,
                    device: str = "cpu", batch_size: int = 16) -> list[float]:
    """Top-1 agreement with the target at each TTT step over blocks [N, T] (e.g. held-out code)."""
    from transformers import LlamaForCausalLM  # training-only dependency

    from splitspec.model.loader import load_eagle3

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=dtype).to(dev).eval()
    head = load_eagle3(head_dir, torch.float32, dev)
    draft_ids = torch.nonzero(head.t2d).flatten()
    layers = read_hf_config(target_dir)["num_hidden_layers"]
    capture = head.config.aux_layer_inputs(layers)
    hits = torch.zeros(ttt_steps)
    counts = torch.zeros(ttt_steps)
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        for lo in range(0, blocks.shape[0], batch_size):
            batch = _target_batch(target, blocks[lo: lo + batch_size].to(dev), capture,
                                  draft_ids.to(dev))
            top = batch.labels.argmax(-1)
            for step, logits in enumerate(ttt_forward(head, batch, ttt_steps)):
                agree = logits[:, step:].argmax(-1) == top[:, step:]
                hits[step] += agree.sum().item()
                counts[step] += agree.numel()
    return (hits / counts).tolist()


def save_head(head: Eagle3Head, config: dict[str, Any], out_dir: Path) -> None:
    """Write config.json and model.safetensors in the SGLang / vLLM layout (bf16 weights)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, value in head.state_dict().items():
        value = value.detach().cpu().contiguous()
        tensors[name] = value if name in ("d2t", "t2d") else value.to(torch.bfloat16)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
