"""The training package: the held-out split, blocks, prompts, the shared training loop, the
pipeline (deterministic, size-checked, blind to held-out files) and ``splitspec train-draft``."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from splitspec import cli
from splitspec.builtin import BUILTIN_TARGET, build
from splitspec.training import data, lm, pipeline
from tests.stack import REPO, Service

MARKER = "zqxvelociraptorzqxv"  # only in held-out files


def tiny_llama(**sizes: int) -> dict:
    values = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8}
    return {**lm.BASE_LLAMA_CONFIG, **values, **sizes}


def names(count: int, heldout: bool) -> list[str]:
    """The first ``count`` names pkg/mod_<i>.py that are (or are not) held out."""
    found = (f"pkg/mod_{i}.py" for i in range(10_000))
    return [n for n in found if data.is_heldout(n) == heldout][:count]


def module_text(i: int) -> str:
    return "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n\n" for j in range(12))


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """60 train files and 3 held-out ones (those alone hold MARKER); a cache folder to skip."""
    root = tmp_path_factory.mktemp("corpus")
    for i, name in enumerate(names(60, heldout=False)):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(module_text(i))
    for i, name in enumerate(names(3, heldout=True)):
        (root / name).write_text(module_text(100 + i) + f"{MARKER} = '{MARKER}'\n" * 40)
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.py").write_text("skipped = True\n")
    (root / "image.png").write_bytes(b"\x89PNG\0\0")
    return root


@pytest.fixture(scope="module")
def tokenizer():
    return data.load_tokenizer(BUILTIN_TARGET)


# --------------------------------------------------------------------------- data


def test_split_is_by_path_deterministic_and_disjoint(corpus_dir):
    corpus = data.collect_corpus([data.folder_source(corpus_dir)], show_progress=False)
    assert len(corpus.files) == 63, "__pycache__ and non-text files are skipped"
    split = data.split_corpus(corpus)
    assert split.heldout.files == names(3, heldout=True)
    assert set(split.train.files) == set(names(60, heldout=False))
    assert all(MARKER not in text for text in split.train.texts)
    assert all(MARKER in text for text in split.heldout.texts)
    again = data.split_corpus(data.collect_corpus([data.folder_source(corpus_dir)],
                                                  show_progress=False))
    assert again.heldout.files == split.heldout.files
    assert again.train.sha256 == split.train.sha256
    # About 1 in 20 paths, decided by the path alone.
    share = sum(data.is_heldout(f"lib/m{i}.py") for i in range(4000)) / 4000
    assert 0.04 < share < 0.06


def test_split_refuses_a_corpus_with_no_heldout_file(tmp_path):
    for name in names(3, heldout=False):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    corpus = data.collect_corpus([data.folder_source(tmp_path)], show_progress=False)
    with pytest.raises(ValueError, match="use a larger corpus"):
        data.split_corpus(corpus)


def test_pack_blocks_separates_documents_with_eos_and_round_trips(tokenizer):
    texts = ["def a():\n    return 1\n", "x = [1, 2]  # list\n", "\tclass B: pass\n"]
    lengths = [len(tokenizer.encode(t).ids) + 1 for t in texts]
    total = sum(lengths)
    blocks = data.pack_blocks(tokenizer, texts, total)
    assert blocks.dtype == torch.int64 and blocks.shape == (1, total)
    stream = blocks.flatten().tolist()
    ends = [sum(lengths[:i + 1]) - 1 for i in range(len(texts))]
    assert [i for i, t in enumerate(stream) if t == data.EOS_ID] == ends
    decoded = tokenizer.decode(stream, skip_special_tokens=False)
    assert decoded.split(data.EOS_TOKEN) == [*texts, ""]
    rows = data.pack_blocks(tokenizer, texts, 5)
    assert rows.shape == (total // 5, 5), "the tail that does not fill a row is dropped"
    assert rows.flatten().tolist() == stream[:rows.numel()]
    with pytest.raises(ValueError, match="do not fill one block"):
        data.pack_blocks(tokenizer, texts, total + 1)


def test_heldout_prompts_are_deterministic_line_starts(corpus_dir, tokenizer):
    heldout = data.split_corpus(data.collect_corpus([data.folder_source(corpus_dir)],
                                                    show_progress=False)).heldout
    prompts = data.heldout_prompts(heldout, tokenizer, num=5, prompt_len=12)
    assert prompts == data.heldout_prompts(heldout, tokenizer, num=5, prompt_len=12)
    assert len(prompts) == 5
    for prompt in prompts:
        text = heldout.texts[heldout.files.index(prompt.file)]
        line_start = sum(len(line) for line in text.splitlines(keepends=True)[:prompt.line - 1])
        assert len(prompt.ids) == 12
        assert text[line_start:].startswith(prompt.text)
        assert text[line_start:].split("\n", 1)[0].strip(), "starts on a non-blank line"


# --------------------------------------------------------------------------- training loop


def repeated_blocks() -> torch.Tensor:
    """Four random rows repeated: a few steps can learn them."""
    return torch.randint(2, 64, (4, 24), generator=torch.Generator().manual_seed(0)).repeat(6, 1)


def test_train_causal_lm_reduces_loss_and_is_deterministic():
    blocks = repeated_blocks()
    cfg = lm.TrainConfig(steps=25, batch_size=8, lr=3e-3, warmup_steps=2, show_progress=False)
    before = lm.perplexity(lm.build_llama(tiny_llama(), cfg.seed), blocks, 8, "cpu")
    result = lm.train_causal_lm(tiny_llama(), blocks, cfg)
    after = lm.perplexity(result.model, blocks, 8, "cpu")
    assert after < 0.5 * before, (before, after)
    assert result.tokens == 25 * 8 * 24
    again = lm.train_causal_lm(tiny_llama(), blocks, cfg).model.state_dict()
    assert all(torch.equal(v, again[k]) for k, v in result.model.state_dict().items())


def test_distill_causal_lm_moves_the_student_towards_the_teacher():
    blocks = repeated_blocks()
    cfg = lm.TrainConfig(steps=25, batch_size=8, lr=3e-3, warmup_steps=2, show_progress=False)
    teacher = lm.train_causal_lm(tiny_llama(), blocks, cfg).model
    student_cfg = tiny_llama(hidden_size=16, head_dim=4, num_hidden_layers=1)
    kl = lm.distillation_loss(teacher)
    before = kl(lm.build_llama(student_cfg, cfg.seed), blocks).item()
    result = lm.distill_causal_lm(student_cfg, teacher, blocks, cfg)
    after = kl(result.model, blocks).item()
    assert after < 0.5 * before, (before, after)
    assert not any(p.requires_grad for p in teacher.parameters()), "the teacher stays frozen"
    assert lm.agreement(result.model, teacher, blocks, 8, "cpu") > 0.5
    with pytest.raises(ValueError, match="vocab_size"):
        lm.distill_causal_lm(tiny_llama(vocab_size=65), teacher, blocks, cfg)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = lm.TrainConfig(steps=100, batch_size=1, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    factors = [lm.lr_factor(s, cfg) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:], strict=False))
    assert factors[-1] == pytest.approx(0.1, abs=1e-3)


def test_save_llama_writes_bf16_with_flat_keys_and_keeps_the_model(tmp_path):
    model = lm.build_llama(tiny_llama(), seed=0)
    lm.save_llama(model, tmp_path / "m", tokenizer_dir=BUILTIN_TARGET)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["rope_theta"] == 10000.0
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert next(model.parameters()).dtype == torch.float32
    assert (tmp_path / "m" / "tokenizer.json").is_file()


# --------------------------------------------------------------------------- pipeline


TINY = pipeline.Preset(
    name="tiny", corpus=(), max_corpus_bytes=2**20, tokenizer_vocab=300,
    tokenizer_sample_chars=2**20, block_len=32,
    target={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8},
    draft={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8},
    draft_vocab_size=128, ttt_steps=2,
    target_train=pipeline.Stage(3, 4, 1e-3, 1), eagle3_train=pipeline.Stage(2, 4, 1e-3, 1),
    draft_train=pipeline.Stage(2, 4, 1e-3, 1), eval_blocks=4, eval_batch_size=4)


def test_pipeline_is_deterministic_and_never_sees_heldout_files(tmp_path, corpus_dir,
                                                                monkeypatch):
    seen: list[torch.Tensor] = []
    real_loop = lm.train_loop
    monkeypatch.setattr(lm, "train_loop",
                        lambda model, blocks, *a: seen.append(blocks) or real_loop(model, blocks, *a))
    runs = [pipeline.run_pipeline(TINY, tmp_path / name, seed=3, corpus_dir=corpus_dir,
                                  show_progress=False) for name in ("one", "two")]
    assert runs[0]["files"] == runs[1]["files"]
    assert sorted({f.split("/")[0] for f in runs[0]["files"]}) == ["draft", "eagle3", "target"]
    assert runs[0]["corpus"]["heldout"]["files"] == names(3, heldout=True)
    tok = data.load_tokenizer(tmp_path / "one" / "target")
    assert not any(MARKER[:6] in piece for piece in tok.get_vocab()), "BPE saw held-out text"
    assert len(seen) == 4, "target and draft of each run"
    for blocks in seen:
        assert MARKER not in tok.decode(blocks.flatten().tolist(), skip_special_tokens=False)
    quality = runs[0]["quality"]
    assert len(quality["eagle3_step_accuracy"]) == 2
    assert quality["target_perplexity"] > 1 and 0 <= quality["draft_agreement"] <= 1


def test_pipeline_fails_loudly_before_training_when_too_large(tmp_path, corpus_dir):
    small = dataclasses.replace(TINY, max_total_bytes=10_000)
    with pytest.raises(RuntimeError, match="over its limit"):
        pipeline.run_pipeline(small, tmp_path, corpus_dir=corpus_dir, show_progress=False)
    assert not (tmp_path / "target").exists()


def test_presets_fit_their_budgets():
    assert pipeline.predicted_bytes(pipeline.PRESETS["builtin"], 2048) < pipeline.BUILTIN_MAX_BYTES
    from transformers import LlamaForCausalLM

    bench = pipeline.PRESETS["bench"]
    with torch.device("meta"):
        target = LlamaForCausalLM(lm.llama_config(pipeline.model_values(bench, bench.target,
                                                                        bench.tokenizer_vocab)))
        draft = LlamaForCausalLM(lm.llama_config(pipeline.model_values(bench, bench.draft,
                                                                       bench.tokenizer_vocab)))
    assert 100e6 < lm.num_parameters(target) < 300e6
    assert 15e6 < lm.num_parameters(draft) < 35e6
    scaled = bench.scaled(0.01)
    assert scaled.target_train.steps == 9 and scaled.eagle3_train.steps >= 1


def test_build_command_runs_the_builtin_preset():
    parser = pipeline.build_parser("python -m splitspec.builtin.build", preset="builtin",
                                   default_out=build.DEFAULT_OUT)
    args = parser.parse_args(["--steps-scale", "0.5", "--device", "cuda"])
    assert args.preset == "builtin" and args.out == build.DEFAULT_OUT
    with pytest.raises(SystemExit):
        parser.parse_args(["--preset", "bench"])


# --------------------------------------------------------------------------- train-draft


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    """A random 4-layer Llama with the built-in tokenizer."""
    out = tmp_path_factory.mktemp("target") / "target"
    return build.write_llama(out, {"hidden_size": 64, "intermediate_size": 128,
                                   "num_hidden_layers": 4, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "head_dim": 16},
                             seed=0, tokenizer_dir=BUILTIN_TARGET)


def test_train_draft_refuses_bad_inputs_clearly(tmp_path, tiny_target, corpus_dir, capsys):
    base = ["train-draft", "--out", str(tmp_path / "head")]
    assert cli.main([*base, "--target", str(tmp_path), "--corpus", str(corpus_dir)]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert cli.main([*base, "--target", str(tiny_target), "--corpus", str(tmp_path / "no")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main([*base, "--target", str(tiny_target), "--corpus", str(tmp_path / "empty")]) == 2
    assert "is empty" in capsys.readouterr().err
    if not torch.cuda.is_available():  # asked for a GPU that is not there: before the corpus
        assert cli.main([*base, "--target", str(tiny_target), "--corpus", str(corpus_dir),
                         "--device", "cuda"]) == 2
        assert "--device cuda: torch" in capsys.readouterr().err
    shapeless = tmp_path / "shapeless"  # a config.json without the model's shape
    shapeless.mkdir()
    (shapeless / "config.json").write_text('{"model_type": "llama", "eos_token_id": 0}')
    (shapeless / "tokenizer.json").write_text((tiny_target / "tokenizer.json").read_text())
    assert cli.main([*base, "--target", str(shapeless), "--corpus", str(corpus_dir)]) == 2
    assert f"--target {shapeless}: {shapeless}/config.json lacks vocab_size, hidden_size" in \
        capsys.readouterr().err
    eosless = tmp_path / "eosless"  # nothing to separate the corpus files with
    eosless.mkdir()
    config = json.loads((tiny_target / "config.json").read_text())
    del config["eos_token_id"]
    (eosless / "config.json").write_text(json.dumps(config))
    (eosless / "tokenizer.json").write_text((tiny_target / "tokenizer.json").read_text())
    assert cli.main([*base, "--target", str(eosless), "--corpus", str(corpus_dir)]) == 2
    assert f"{eosless}/config.json has no eos_token_id" in capsys.readouterr().err
    assert not (tmp_path / "head").exists()


@pytest.mark.slow
def test_train_draft_end_to_end_and_the_draft_service_loads_the_head(tmp_path, tiny_target,
                                                                     corpus_dir):
    out = tmp_path / "head"
    done = subprocess.run(
        [sys.executable, "-m", "splitspec.cli", "train-draft", "--target", str(tiny_target),
         "--corpus", str(corpus_dir), "--out", str(out), "--steps", "3", "--batch-size", "4",
         "--block-len", "64", "--draft-vocab-size", "256", "--device", "cpu"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"splitspec up --target-model {tiny_target} --draft-model {out}\n" in done.stdout
    assert f"python -m draft_service --model {out} --target-model {tiny_target}" in done.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 256 and config["vocab_size"] == 2048
    tensors = load_file(out / "model.safetensors")
    assert tuple(tensors["fc.weight"].shape) == (64, 3 * 64)
    assert tuple(tensors["d2t"].shape) == (256,) and int(tensors["t2d"].sum()) == 256
    draft = Service("draft_service", ["--model", str(out), "--target-model", str(tiny_target)],
                    log_dir=tmp_path)
    try:
        draft.wait_serving()
    finally:
        draft.stop()
