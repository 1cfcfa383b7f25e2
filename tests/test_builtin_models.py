"""The committed built-in models load, match their documented format, and match the manifest."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from splitspec.builtin import BUILTIN_DRAFT, BUILTIN_EAGLE3, BUILTIN_TARGET, MODELS_DIR, build
from splitspec.model.config import read_hf_config
from splitspec.training import data
from splitspec.training.eagle3 import head_config
from splitspec.training.pipeline import PRESETS

PRESET = PRESETS["builtin"]
TARGET_CONFIG = read_hf_config(BUILTIN_TARGET)
V, VD = TARGET_CONFIG["vocab_size"], PRESET.draft_vocab_size
H = HT = TARGET_CONFIG["hidden_size"]

SNIPPET = (
    "import os\n\n\nclass Walker:\n"
    '    """Walk a tree."""\n\n'
    "    def __init__(self, root: str = '.') -> None:\n"
    "        self.root = root  # where to start\n\n"
    "    def run(self):\n"
    "\tfor d, _, fs in os.walk(self.root):\n"
    "            yield from (os.path.join(d, f) for f in fs if f.endswith('.py'))\n"
    "  x = [1,2 , 3]  ;  y = {'a': x}\r\n"
)

EXPECTED_EAGLE3_CONFIG = head_config(TARGET_CONFIG, VD, PRESET.head_overrides)


def expected_eagle3_tensors(cfg: dict) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The SGLang / vLLM EAGLE-3 layout (names, dtypes, shapes) implied by a head's config."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    bf16 = torch.bfloat16
    return {
        "fc.weight": (bf16, (h, 3 * cfg["target_hidden_size"])),
        "embed_tokens.weight": (bf16, (cfg["vocab_size"], h)),
        "midlayer.input_layernorm.weight": (bf16, (h,)),
        "midlayer.hidden_norm.weight": (bf16, (h,)),
        "midlayer.post_attention_layernorm.weight": (bf16, (h,)),
        "midlayer.self_attn.q_proj.weight": (bf16, (q, 2 * h)),
        "midlayer.self_attn.k_proj.weight": (bf16, (kv, 2 * h)),
        "midlayer.self_attn.v_proj.weight": (bf16, (kv, 2 * h)),
        "midlayer.self_attn.o_proj.weight": (bf16, (h, q)),
        "midlayer.mlp.gate_proj.weight": (bf16, (inter, h)),
        "midlayer.mlp.up_proj.weight": (bf16, (inter, h)),
        "midlayer.mlp.down_proj.weight": (bf16, (h, inter)),
        "norm.weight": (bf16, (h,)),
        "lm_head.weight": (bf16, (cfg["draft_vocab_size"], h)),
        "d2t": (torch.int64, (cfg["draft_vocab_size"],)),
        "t2d": (torch.bool, (cfg["vocab_size"],)),
    }


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_json(path: Path) -> dict:
    """Load a JSON file."""
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def target_model():
    """The built-in target, loaded by transformers in float32."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(BUILTIN_TARGET, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def auto_tokenizer():
    """The built-in tokenizer, loaded by transformers."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BUILTIN_TARGET)


@pytest.fixture(scope="module")
def eagle3_tensors() -> dict[str, torch.Tensor]:
    """Every tensor of the built-in EAGLE-3 head."""
    return load_file(BUILTIN_EAGLE3 / "model.safetensors")


# --------------------------------------------------------------------------- target


def test_target_config_and_weights_are_bf16():
    assert {k: TARGET_CONFIG[k] for k in PRESET.target} == PRESET.target
    assert TARGET_CONFIG["architectures"] == ["LlamaForCausalLM"]
    with safe_open(BUILTIN_TARGET / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}
    gen = read_json(BUILTIN_TARGET / "generation_config.json")
    assert gen["bos_token_id"] == 0
    assert gen["eos_token_id"] == 0


def test_target_loads_and_gives_logits(target_model, auto_tokenizer):
    assert target_model.config.vocab_size == V
    ids = torch.tensor([auto_tokenizer(SNIPPET)["input_ids"]])
    with torch.no_grad():
        out = target_model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], V)
    assert torch.isfinite(out.logits).all()
    # Trained on code: this snippet (written for the test, never trained on) is predictable.
    assert float(out.loss.exp()) < 60, f"perplexity {float(out.loss.exp()):.1f}: broken weights?"


def test_tokenizer_round_trips_python_exactly(auto_tokenizer):
    ids = auto_tokenizer(SNIPPET)["input_ids"]
    assert len(ids) < len(SNIPPET) / 2, "BPE should compress Python source"
    assert auto_tokenizer.decode(ids) == SNIPPET
    assert auto_tokenizer.decode(auto_tokenizer(" leading space")["input_ids"]) == " leading space"


def test_tokenizer_special_tokens(auto_tokenizer):
    assert len(auto_tokenizer) == V
    assert auto_tokenizer.eos_token == auto_tokenizer.bos_token == "<|endoftext|>"
    assert auto_tokenizer.eos_token_id == auto_tokenizer.bos_token_id == 0
    assert auto_tokenizer.pad_token == "<|pad|>"
    assert auto_tokenizer.pad_token_id == 1
    assert auto_tokenizer.model_max_length == 2048


def test_raw_tokenizer_agrees_with_auto_tokenizer(auto_tokenizer):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(BUILTIN_TARGET / "tokenizer.json"))
    assert raw.get_vocab_size() == V
    enc = raw.encode(SNIPPET)
    assert enc.ids == auto_tokenizer(SNIPPET)["input_ids"]
    assert raw.decode(enc.ids) == SNIPPET


# --------------------------------------------------------------------------- eagle-3


def test_eagle3_config_is_exactly_the_documented_one():
    config = read_json(BUILTIN_EAGLE3 / "config.json")
    assert config == EXPECTED_EAGLE3_CONFIG
    assert "eagle_config" not in config


def test_eagle3_tensor_names_dtypes_shapes(eagle3_tensors):
    got = {k: (t.dtype, tuple(t.shape)) for k, t in eagle3_tensors.items()}
    assert got == expected_eagle3_tensors(EXPECTED_EAGLE3_CONFIG)


def test_eagle3_d2t_t2d_consistent(eagle3_tensors):
    d2t, t2d = eagle3_tensors["d2t"], eagle3_tensors["t2d"]
    target_ids = torch.arange(VD) + d2t
    assert bool(t2d[target_ids].all())
    assert int(t2d.sum()) == VD
    assert bool((target_ids[1:] > target_ids[:-1]).all()), "draft ids sorted by target id"
    assert torch.equal(torch.nonzero(t2d).flatten(), target_ids)


def test_eagle3_draft_vocab_is_most_frequent_tokens(eagle3_tensors, auto_tokenizer):
    target_ids = set((torch.arange(VD) + eagle3_tensors["d2t"]).tolist())
    common = auto_tokenizer("    def __init__(self):\n        return None\n")["input_ids"]
    assert set(common) <= target_ids


def test_eagle3_embedding_is_the_targets(eagle3_tensors):
    target = load_file(BUILTIN_TARGET / "model.safetensors")
    assert torch.equal(eagle3_tensors["embed_tokens.weight"], target["model.embed_tokens.weight"])


# --------------------------------------------------------------------------- draft


def test_draft_loads_and_shares_tokenizer(auto_tokenizer):
    from transformers import LlamaForCausalLM

    draft = LlamaForCausalLM.from_pretrained(BUILTIN_DRAFT, dtype=torch.float32).eval()
    assert draft.config.hidden_size == PRESET.draft["hidden_size"]
    assert draft.config.num_hidden_layers == PRESET.draft["num_hidden_layers"]
    assert draft.config.vocab_size == V
    ids = torch.tensor([auto_tokenizer(SNIPPET)["input_ids"]])
    with torch.no_grad():
        assert draft(input_ids=ids).logits.shape == (1, ids.shape[1], V)
    for name in data.TOKENIZER_FILES:
        assert sha256(BUILTIN_DRAFT / name) == sha256(BUILTIN_TARGET / name)


# --------------------------------------------------------------------------- manifest


def test_manifest_matches_files_on_disk():
    manifest = read_json(MODELS_DIR / "manifest.json")
    on_disk = {
        p.relative_to(MODELS_DIR).as_posix()
        for p in MODELS_DIR.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    assert set(manifest["files"]) == on_disk
    for rel, entry in manifest["files"].items():
        path = MODELS_DIR / rel
        assert sha256(path) == entry["sha256"], f"stale manifest entry for {rel}"
        assert path.stat().st_size == entry["bytes"]
    assert manifest["command"].startswith(("python -m splitspec.builtin.build",
                                           "python -m splitspec.training.pipeline --preset builtin"))
    assert isinstance(manifest["seed"], int)
    assert manifest["corpus"]["num_files"] > 0
    quality = manifest["quality"]
    assert quality["target_perplexity"] < 20 and min(quality["eagle3_step_accuracy"]) > 0.5


def test_sizes():
    total = sum(p.stat().st_size for p in MODELS_DIR.rglob("*") if p.is_file())
    assert total < 15_000_000, "the built-in pair must stay under 15 MB"


# --------------------------------------------------------------------------- builder


def test_choose_draft_vocab_ties_by_id_and_keeps_zero():
    counts = np.array([0, 5, 9, 5, 1, 9, 0, 5])
    assert build.choose_draft_vocab(counts, 4).tolist() == [0, 1, 2, 5]
    d2t, t2d = build.draft_maps(np.array([0, 2, 5]), 8)
    assert d2t.tolist() == [0, 1, 3]
    assert t2d.tolist() == [True, False, True, False, False, True, False, False]


def test_write_llama_with_other_vocab_and_no_tokenizer(tmp_path):
    from transformers import LlamaForCausalLM

    out = build.write_llama(tmp_path / "draft", {"vocab_size": 1000, "num_hidden_layers": 1})
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.vocab_size == 1000
    assert model(input_ids=torch.tensor([[1, 999]])).logits.shape == (1, 2, 1000)


def test_write_eagle3_head_follows_target_and_overrides(tmp_path):
    target = build.write_llama(tmp_path / "t", {"hidden_size": 64, "head_dim": 16}, seed=3)
    head = build.write_eagle3_head(
        tmp_path / "e", target, draft_vocab_size=100, config_overrides={"target_hidden_size": 96}
    )
    config = read_json(head / "config.json")
    assert config["hidden_size"] == 64
    assert config["target_hidden_size"] == 96
    tensors = load_file(head / "model.safetensors")
    assert tuple(tensors["fc.weight"].shape) == (64, 3 * 96)
    assert tuple(tensors["lm_head.weight"].shape) == (100, 64)
    assert tensors["d2t"].tolist() == [0] * 100  # no counts: draft ids are 0..99
