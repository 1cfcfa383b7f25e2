"""Model configurations read from Hugging Face config.json files."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes "rope_parameters"; older checkpoints "rope_scaling".
        scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = float(cfg.get("rope_theta", scaling.get("rope_theta", 10000.0)))
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {kind!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if kind == "default":
            return cls(theta=theta)
        return cls(
            theta=theta,
            kind=kind,
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position=int(scaling.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-architecture decoder (target, standalone draft or EAGLE-3 layer)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> LlamaConfig:
        """From a parsed config.json; ``source`` (the file) names it in the errors."""
        if cfg.get("model_type", "llama") != "llama":
            raise ValueError(f"model_type {cfg.get('model_type')!r} is not a Llama architecture")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias checkpoints are not supported")
        missing = [key for key in LLAMA_SHAPE_KEYS if cfg.get(key) is None]
        if missing:
            raise ValueError(f"{source} lacks {', '.join(missing)}: a Llama config gives "
                             f"{', '.join(LLAMA_SHAPE_KEYS)}")
        count = {key: _count(cfg, key, source) for key in LLAMA_SHAPE_KEYS}
        heads, hidden = count["num_attention_heads"], count["hidden_size"]
        kv_heads = _count(cfg, "num_key_value_heads", source) if cfg.get("num_key_value_heads") else heads
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
        if cfg.get("head_dim"):
            head_dim = _count(cfg, "head_dim", source)
        elif hidden % heads:
            raise ValueError(f"{source}: hidden_size {hidden} is not a multiple of "
                             f"num_attention_heads {heads}, and no head_dim is given")
        else:
            head_dim = hidden // heads
        eos_ids = _token_ids(cfg, "eos_token_id", source)
        return cls(
            vocab_size=count["vocab_size"],
            hidden_size=hidden,
            intermediate_size=count["intermediate_size"],
            num_layers=count["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def read(cls, model_dir: Path) -> LlamaConfig:
        """The config of the checkpoint folder ``model_dir``. Its EOS ids are those of
        config.json and of generation_config.json, where there is one: an Instruct
        checkpoint may name its end-of-turn token (Llama-3's ``<|eot_id|>``) only there,
        and Hugging Face's ``generate``, vLLM and SGLang stop on both."""
        config = cls.from_hf(read_hf_config(model_dir), str(Path(model_dir) / "config.json"))
        path = Path(model_dir) / GENERATION_CONFIG
        if not path.is_file():
            return config
        more = _token_ids(read_json_object(path), "eos_token_id", str(path))
        eos_ids = tuple(dict.fromkeys(config.eos_token_ids + more))  # (config.json's first)
        return dataclasses.replace(config, eos_token_ids=eos_ids)


GENERATION_CONFIG = "generation_config.json"

# what a Llama config.json must give (the rest have defaults)
LLAMA_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")


def _count(cfg: dict[str, Any], key: str, source: str) -> int:
    """``cfg[key]`` as a positive whole number (JSON may write 4096 as 4096.0)."""
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 \
            or value != int(value):
        raise ValueError(f"{source}: {key} must be a positive whole number, not {value!r}")
    return int(value)


def _token_ids(cfg: dict[str, Any], key: str, source: str) -> tuple[int, ...]:
    """``cfg[key]``, a token id or a list of them (or absent: none), as a tuple of ids."""
    value = cfg.get(key)
    ids = value if isinstance(value, list) else ([] if value is None else [value])
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"{source}: {key} must be a token id or a list of them, not {value!r}")
    return tuple(ids)


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"{model_dir} is not a folder: a checkpoint is a folder with "
                                f"config.json")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a checkpoint folder needs config.json")
    return read_json_object(path)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; a ValueError naming the file if it holds anything else."""
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:  # (re-raised with the file's name)
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds a JSON {type(cfg).__name__}, not an object")
    return cfg


EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 head: one decoder layer over [embedding ‖ fused target features].

    ``aux_layer_inputs`` are the target layers whose *inputs* the head reads.
    Convention (SGLang's and SpecForge's): explicit
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` name layer *outputs*, so
    id i means the input of layer i + 1; without them the default is the
    inputs of layers 2, N // 2 and N - 3 of an N-layer target (both engines).
    """

    layer: LlamaConfig
    draft_vocab_size: int
    target_hidden_size: int
    explicit_aux_ids: tuple[int, ...] | None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> Eagle3Config:
        """From a parsed config.json; ``source`` (the file) names it in the errors."""
        archs = cfg.get("architectures") or []
        if not any(a in EAGLE3_ARCHITECTURES for a in archs):
            raise ValueError(f"{source}: architectures {archs} is not an EAGLE-3 head "
                             f"(expected one of {EAGLE3_ARCHITECTURES})")
        layer = LlamaConfig.from_hf(cfg, source)
        if layer.num_layers != 1:
            raise ValueError(f"{source}: EAGLE-3 head has num_hidden_layers={layer.num_layers}; "
                             f"only 1 is supported")
        eagle = cfg.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            layer=layer,
            draft_vocab_size=int(cfg.get("draft_vocab_size") or layer.vocab_size),
            target_hidden_size=int(cfg.get("target_hidden_size") or layer.hidden_size),
            explicit_aux_ids=tuple(int(i) for i in ids) if ids else None,
        )

    @classmethod
    def read(cls, model_dir: Path) -> Eagle3Config:
        """The config of the head's checkpoint folder ``model_dir``."""
        return cls.from_hf(read_hf_config(model_dir), str(Path(model_dir) / "config.json"))

    def aux_layer_inputs(self, target_num_layers: int) -> tuple[int, ...]:
        """The target layers whose inputs are captured (index N = the final pre-norm output)."""
        if self.explicit_aux_ids is not None:
            picked = tuple(i + 1 for i in self.explicit_aux_ids)
        else:
            n = target_num_layers
            picked = (2, n // 2, n - 3)
        bad = [i for i in picked if not 0 <= i <= target_num_layers]
        if bad:
            raise ValueError(f"EAGLE-3 head captures target layer inputs {picked}, but the target "
                             f"has {target_num_layers} layers")
        return picked


def is_eagle3(cfg: dict[str, Any]) -> bool:
    return any(a in EAGLE3_ARCHITECTURES for a in cfg.get("architectures") or [])
