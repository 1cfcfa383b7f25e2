"""The draft models behind one interface, so the drafter treats both kinds alike.

Both kinds run over *entries*: the units whose K/V the draft caches for the
committed part of a sequence of tokens t_0..t_n.

- standalone (a small causal LM): entry i is token t_i at position i, for
  i = 0..n; the last entry (the root t_n) predicts depth 1.
- eagle3 (an EAGLE-3 head): entry i is (the target's features h_i fused by
  ``fc``, the embedding of t_{i+1}) at position i, for i = 0..n-1; the last
  entry predicts depth 1, so t_n needs no features yet.

A tree node at depth d is run at position (last entry position + d); its input
is its token and, for EAGLE-3, its parent's ``g`` (a depth-1 node's parent is
the root: the last entry's ``g``). Each model returns a per-row *state*
([T, X]; the normed hidden state for a standalone LM, ``g`` for EAGLE-3) from
which :meth:`DraftModel.logits` computes draft-vocabulary logits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from splitspec.kernels import top_logprobs_torch
from splitspec.model.config import Eagle3Config, LlamaConfig, is_eagle3, read_hf_config
from splitspec.model.eagle3 import Eagle3Head
from splitspec.model.layers import AttentionContext
from splitspec.model.llama import LlamaForCausalLM
from splitspec.model.loader import load_eagle3, load_llama, safetensors_files
from splitspec.tokenizer import TOKENIZER_FILE, tokenizer_sha256

EAGLE3 = "eagle3"
STANDALONE = "standalone"
REPLAY = "replay"  # the benchmark draft of draft_service/replay.py: no model
TARGET_EMBEDDING = "model.embed_tokens.weight"


class EntrySpan(NamedTuple):
    first: int          # position (= logical cache slot) of the first new entry
    tokens: list[int]   # each new entry's input token, in order


@dataclass(frozen=True)
class DraftSpec:
    """What start-up learns from the config files alone (no weights): the DraftInfo facts."""

    kind: str
    model_dir: Path
    target_dir: Path | None
    vocab_size: int                     # target-vocabulary ids the draft reads and emits
    target_hidden_size: int             # 0 for a standalone draft
    aux_layer_inputs: tuple[int, ...]   # () = the default layers
    target_num_layers: int              # 0 when unknown
    tokenizer_sha256: str               # "" when no tokenizer.json was found
    label: str = ""                     # the name DraftInfo shows; "" = model_dir's name
    features: bool = False              # the replay draft taking an EAGLE-3 head's features
    cost: DraftSpec | None = None       # the model the replay draft runs for its time alone

    @property
    def needs_hidden_states(self) -> bool:
        return self.kind == EAGLE3 or self.features

    @property
    def feature_dim(self) -> int:
        """The width of a feature row the target sends: three of its layer inputs, or 0."""
        return 3 * self.target_hidden_size if self.needs_hidden_states else 0

    @property
    def name(self) -> str:
        return self.label or self.model_dir.name


def read_spec(model_dir: Path, kind: str, target_dir: Path | None) -> DraftSpec:
    """Resolve the kind ("auto" reads config.json) and the facts the target checks at connect."""
    hf, source = read_hf_config(model_dir), str(model_dir / "config.json")
    detected = EAGLE3 if is_eagle3(hf) else STANDALONE
    if kind not in ("auto", detected):
        raise ValueError(f"--kind {kind} but {model_dir}/config.json describes a draft of kind "
                         f"{detected} (architectures {hf.get('architectures')}); use --kind auto "
                         f"or {detected}")
    target_layers = 0
    if target_dir is not None:
        target_layers = LlamaConfig.read(target_dir).num_layers
    sha = ""
    for folder in (model_dir, target_dir):
        if folder is not None and (folder / TOKENIZER_FILE).is_file():
            sha = tokenizer_sha256(folder)
            break
    if detected == STANDALONE:
        llama = LlamaConfig.from_hf(hf, source)
        return DraftSpec(STANDALONE, model_dir, target_dir, llama.vocab_size, 0, (), target_layers, sha)
    eagle = Eagle3Config.from_hf(hf, source)
    aux: tuple[int, ...] = ()
    if eagle.explicit_aux_ids is not None:
        # Explicit ids name layer outputs: id i is the input of layer i + 1 (Eagle3Config's convention).
        aux = (eagle.aux_layer_inputs(target_layers) if target_layers
               else tuple(i + 1 for i in eagle.explicit_aux_ids))
    elif target_layers:
        eagle.aux_layer_inputs(target_layers)  # raises when the target is too shallow for the defaults
    return DraftSpec(EAGLE3, model_dir, target_dir, eagle.layer.vocab_size, eagle.target_hidden_size,
                     aux, target_layers, sha)


class DraftModel(ABC):
    """A draft model over entries and tree nodes (see the module docstring)."""

    kind: str
    vocab_size: int        # target-vocabulary size: valid input ids, and the ids trees carry
    draft_vocab_size: int  # logits width (EAGLE-3 heads may draft from a smaller vocabulary)
    feature_dim: int       # width of one row of target features; 0 = none needed
    num_layers: int        # KV-cache layers
    num_heads: int
    num_kv_heads: int
    head_dim: int
    state_width: int       # X, the width of a state row
    dtype: torch.dtype
    device: torch.device
    module: torch.nn.Module  # the loaded weights
    d2t: torch.Tensor | None = None  # target id = draft id + d2t[draft id]; None: the same ids

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    @abstractmethod
    def entries(self, start: int, new_tokens: list[int]) -> EntrySpan:
        """The entries to (re)build when new_tokens[0] sits at position start."""

    @abstractmethod
    def num_entries(self, num_tokens: int) -> int:
        """Entries of a committed sequence of num_tokens tokens."""

    @abstractmethod
    def forward_entries(self, tokens: torch.Tensor, features: torch.Tensor | None,
                        positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """States [T, X] of committed entries: tokens [T], features [T, feature_dim] or None."""

    @abstractmethod
    def forward_nodes(self, tokens: torch.Tensor, parent_states: torch.Tensor,
                      positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """States [T, X] of tree nodes: tokens [T] (target ids), their parents' states [T, X]."""

    @abstractmethod
    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [T, V_draft] in float32."""

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target-vocabulary ids."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def top_logprobs(self, states: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k likeliest draft-vocabulary tokens of each state row: log-probabilities
        [T, k] (float32, descending) and ids [T, k]."""
        return top_logprobs_torch(self.logits(states), k)


class StandaloneDraft(DraftModel):
    kind = STANDALONE
    feature_dim = 0

    def __init__(self, model: LlamaForCausalLM) -> None:
        cfg = model.config
        self.model = self.module = model
        self.vocab_size = self.draft_vocab_size = cfg.vocab_size
        self.num_layers, self.num_kv_heads, self.head_dim = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.state_width = cfg.num_heads, cfg.hidden_size
        self.dtype = model.lm_head.weight.dtype
        self.device = model.lm_head.weight.device

    def entries(self, start: int, new_tokens: list[int]) -> EntrySpan:
        return EntrySpan(start, list(new_tokens))

    def num_entries(self, num_tokens: int) -> int:
        return num_tokens

    def forward_entries(self, tokens: torch.Tensor, features: torch.Tensor | None,
                        positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        return self.model(tokens, positions, ctx).hidden

    def forward_nodes(self, tokens: torch.Tensor, parent_states: torch.Tensor,
                      positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        return self.model(tokens, positions, ctx).hidden

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(states)


def eagle3_entries(start: int, new_tokens: list[int]) -> EntrySpan:
    """An EAGLE-3 head's entries to (re)build when new_tokens[0] sits at position start, one
    a feature row the target sends: entry i pairs h_i with t_{i+1}, so the entry before start
    changes with t_start."""
    if start == 0:
        return EntrySpan(0, list(new_tokens[1:]))
    return EntrySpan(start - 1, list(new_tokens))


class Eagle3Draft(DraftModel):
    kind = EAGLE3
    num_layers = 1

    def __init__(self, head: Eagle3Head) -> None:
        cfg = head.config
        self.head = self.module = head
        self.vocab_size = cfg.layer.vocab_size
        self.draft_vocab_size = cfg.draft_vocab_size
        self.feature_dim = 3 * cfg.target_hidden_size
        self.num_kv_heads, self.head_dim = cfg.layer.num_kv_heads, cfg.layer.head_dim
        self.num_heads, self.state_width = cfg.layer.num_heads, cfg.layer.hidden_size
        self.dtype = head.fc.weight.dtype
        self.device = head.fc.weight.device

    def entries(self, start: int, new_tokens: list[int]) -> EntrySpan:
        return eagle3_entries(start, new_tokens)

    def num_entries(self, num_tokens: int) -> int:
        return max(num_tokens - 1, 0)

    def forward_entries(self, tokens: torch.Tensor, features: torch.Tensor | None,
                        positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        if features is None:
            raise ValueError("EAGLE-3 entries need the target's features")
        head = self.head
        return head.step(tokens, head.fuse(features), positions, ctx)

    def forward_nodes(self, tokens: torch.Tensor, parent_states: torch.Tensor,
                      positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        return self.head.step(tokens, parent_states, positions, ctx)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return self.head.logits(states)

    def top_logprobs(self, states: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head.top_logprobs(states, k)

    @property
    def d2t(self) -> torch.Tensor:  # the head's own buffer, wherever it was moved
        return self.head.d2t


def _has_tensor(model_dir: Path, name: str) -> bool:
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 - safe_open has no __contains__
                return True
    return False


def read_target_embedding(target_dir: Path) -> torch.Tensor:
    """The target's token embedding [V, H], read alone from its checkpoint."""
    for path in safetensors_files(target_dir):
        with safe_open(path, framework="pt") as f:
            if TARGET_EMBEDDING in f.keys():  # noqa: SIM118 - safe_open has no __contains__
                return f.get_tensor(TARGET_EMBEDDING)
    raise ValueError(f"target checkpoint {target_dir} has no {TARGET_EMBEDDING}")


def load_draft_model(spec: DraftSpec, dtype: torch.dtype, device: str | torch.device) -> DraftModel:
    if spec.kind == STANDALONE:
        return StandaloneDraft(load_llama(spec.model_dir, dtype, device))
    embedding = None
    if not _has_tensor(spec.model_dir, "embed_tokens.weight"):
        if spec.target_dir is None:
            raise ValueError(f"EAGLE-3 head {spec.model_dir} has no embed_tokens.weight: pass "
                             "--target-model <target checkpoint> so it can use the target's embedding")
        embedding = read_target_embedding(spec.target_dir)
    return Eagle3Draft(load_eagle3(spec.model_dir, dtype, device, embedding))
