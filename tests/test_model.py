"""Our Llama implementation against transformers' (the oracle), through the paged cache."""

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from splitspec.attention import SeqAttention, TorchAttentionBackend
from splitspec.attention.base import SplitAttention, SplitMetadata
from splitspec.attention.cascade import TorchPrefix, TreeVerifyAttention, TreeVerifyMetadata
from splitspec.attention.prompts import PromptAttention, prompt_starts
from splitspec.builtin import BUILTIN_TARGET
from splitspec.kv_cache import KVCache, PagePool, PageTable
from splitspec.model.config import Eagle3Config, LlamaConfig, RopeConfig
from splitspec.model.layers import AttentionContext, rope_inv_freq
from splitspec.model.loader import load_llama
from splitspec.tree import Tree, ancestor_mask, positions, verify_mask


@pytest.fixture(scope="module")
def models():
    ours = load_llama(BUILTIN_TARGET, torch.float32, "cpu")
    theirs = HFLlama.from_pretrained(BUILTIN_TARGET, dtype=torch.float32).eval()
    return ours, theirs


class Runner:
    """One sequence over a fresh paged cache."""

    def __init__(self, model):
        cfg = model.config
        self.model = model
        self.backend = TorchAttentionBackend()
        self.cache = KVCache(cfg.num_layers, 32, 4, cfg.num_kv_heads, cfg.head_dim,
                             torch.float32, "cpu")
        self.pool = PagePool(32)
        self.pool.allocate(3)  # pages out of order, as in a busy pool
        self.table = PageTable(4)
        self.table.reserve(self.pool, 100)

    def run(self, ids, pos, kv_len, mask=None, capture=(), tree=None, cascade=False):
        seq = SeqAttention(self.table, kv_len, len(ids), mask, tree)
        if cascade:  # the verify graphs' two-part attention, its prefix the torch reference
            prefix = TorchPrefix()
            prefix.plan([self.table], [kv_len - len(ids)], len(ids), "cpu")
            meta = TreeVerifyMetadata(self.table.global_slots(kv_len - len(ids), kv_len),
                                      prefix, tree[None])
            ctx = AttentionContext(TreeVerifyAttention(), meta, self.cache)
        else:
            ctx = AttentionContext(self.backend, self.backend.plan([seq], "cpu"), self.cache)
        with torch.inference_mode():
            out = self.model(torch.tensor(ids), pos, ctx, capture)
            return self.model.compute_logits(out.hidden), out.aux


def test_prefill_logits_match_transformers(models):
    ours, theirs = models
    ids = torch.randint(0, ours.config.vocab_size, (23,), generator=torch.Generator().manual_seed(1))
    logits, _ = Runner(ours).run(ids.tolist(), torch.arange(23), 23)
    with torch.inference_mode():
        ref = theirs(ids[None]).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_paged_decode_matches_prefill(models):
    ours, _ = models
    ids = list(range(40, 60))
    full, _ = Runner(ours).run(ids, torch.arange(20), 20)
    runner = Runner(ours)
    runner.run(ids[:12], torch.arange(12), 12)
    for i in range(12, 20):
        step, _ = runner.run([ids[i]], torch.tensor([i]), i + 1)
        torch.testing.assert_close(step[0], full[i], atol=1e-4, rtol=1e-4)


def test_packed_prompts_match_transformers_prompt_by_prompt(models):
    """The prefill graphs' pass (splitspec/attention/prompts.py): prompts packed in one pass,
    each row attending to its own prompt's rows only, give every row the logits transformers
    gives that prompt alone; their K/V land in each sequence's own slots, so a decode step
    over the cache (the torch backend) agrees with transformers too."""
    ours, theirs = models
    cfg = ours.config
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (9, 1, 17)]
    cache = KVCache(cfg.num_layers, 32, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    pool = PagePool(32)
    pool.allocate(3)
    tables = []
    for prompt in prompts:
        tables.append(PageTable(4))
        tables[-1].reserve(pool, len(prompt) + 1)
    backend = PromptAttention()
    seqs = [SeqAttention(t, len(p), len(p)) for t, p in zip(tables, prompts, strict=True)]
    with torch.inference_mode():
        out = ours(torch.cat(prompts), torch.cat([torch.arange(len(p)) for p in prompts]),
                   AttentionContext(backend, backend.plan(seqs, "cpu"), cache))
        logits = ours.compute_logits(out.hidden)
        rows = 0
        for prompt in prompts:
            want = theirs(prompt[None]).logits[0]
            torch.testing.assert_close(logits[rows: rows + len(prompt)], want, atol=1e-4,
                                       rtol=1e-4)
            rows += len(prompt)
        ends = [int(logits[i].argmax()) for i in (8, 9, 26)]
        torch_backend = TorchAttentionBackend()
        steps = [SeqAttention(t, len(p) + 1, 1) for t, p in zip(tables, prompts, strict=True)]
        out = ours(torch.tensor(ends), torch.tensor([len(p) for p in prompts]),
                   AttentionContext(torch_backend, torch_backend.plan(steps, "cpu"), cache))
        step = ours.compute_logits(out.hidden)
        for i, prompt in enumerate(prompts):
            want = theirs(torch.cat((prompt, torch.tensor([ends[i]])))[None]).logits[0, -1]
            torch.testing.assert_close(step[i], want, atol=1e-4, rtol=1e-4)


def test_split_pass_of_prompts_and_decode_matches_one_torch_pass(models):
    """A mixed step as its CUDA graph runs it (SplitAttention: the prompts' rows through
    PromptAttention, then the decoding rows through the torch backend) against the torch
    backend's one pass over the same batch: the same logits, the same cache."""
    ours, _ = models
    cfg = ours.config
    gen = torch.Generator().manual_seed(4)
    caches = [KVCache(cfg.num_layers, 32, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
              for _ in range(2)]
    caches[1].data.copy_(caches[0].data.normal_())
    pool = PagePool(32)
    tables = []
    for _ in range(4):
        tables.append(PageTable(4))
        tables[-1].reserve(pool, 24)
    # two sequences with 10 and 15 cached slots decode one token; two prompts of 7 and 3
    prompts = [SeqAttention(tables[0], 7, 7), SeqAttention(tables[1], 3, 3)]
    decode = [SeqAttention(tables[2], 11, 1), SeqAttention(tables[3], 16, 1)]
    ids = torch.randint(0, cfg.vocab_size, (12,), generator=gen)
    pos = torch.tensor([*range(7), *range(3), 10, 15])
    torch_backend, prompt_backend = TorchAttentionBackend(), PromptAttention()
    first, second = prompt_backend.plan(prompts, "cpu"), torch_backend.plan(decode, "cpu")
    split = SplitMetadata(torch.cat((first.write_slots, second.write_slots)), 10,
                          (prompt_backend, first), (torch_backend, second))
    with torch.inference_mode():
        got = ours(ids, pos, AttentionContext(SplitAttention(), split, caches[0]), (1,))
        want = ours(ids, pos, AttentionContext(torch_backend, torch_backend.plan(
            [*prompts, *decode], "cpu"), caches[1]), (1,))
        torch.testing.assert_close(ours.compute_logits(got.hidden),
                                   ours.compute_logits(want.hidden), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.aux, want.aux)
    torch.testing.assert_close(caches[0].data, caches[1].data)


def test_prompt_attention_plans_fresh_prompts_only():
    table = PageTable(4)
    table.reserve(PagePool(4), 10)
    with pytest.raises(ValueError, match="fresh prompts only"):
        PromptAttention().plan([SeqAttention(table, 10, 3)], "cpu")  # continues a prefix
    assert prompt_starts([3, 1, 2], 8) == [0, 0, 0, 3, 4, 4, 6, 7]
    with pytest.raises(ValueError, match="do not fit"):
        prompt_starts([5, 4], 8)


@pytest.mark.parametrize("form", ["mask", "tree", "cascade"])
def test_tree_forward_matches_each_branch_decoded_alone(models, form):
    """The verify pass, with its [q, kv_len] mask, with the [q, q] tree (the one-pass
    backend spells the mask out), and in two parts merged (splitspec/attention/cascade.py)."""
    ours, _ = models
    prefix = [11, 12, 13, 14, 15]
    tree = Tree(tokens=[21, 22, 23, 24], parents=[0, 0, 1, 3])  # branches: 21-23-24 and 22
    runner = Runner(ours)
    runner.run(prefix[:-1], torch.arange(4), 4)
    root_pos = 4
    how = ({"mask": verify_mask(tree.parents, 4)} if form == "mask" else
           {"tree": ancestor_mask(tree.parents), "cascade": form == "cascade"})
    logits, _ = runner.run([prefix[-1], *tree.tokens], positions(tree.parents, root_pos),
                           kv_len=4 + 5, **how)
    for index, branch in ((3, [21, 23]), (4, [21, 23, 24]), (2, [22])):
        seq = prefix + branch
        ref, _ = Runner(ours).run(seq, torch.arange(len(seq)), len(seq))
        torch.testing.assert_close(logits[index], ref[-1], atol=1e-4, rtol=1e-4)


def test_captured_layer_inputs_match_transformers_hidden_states(models):
    ours, theirs = models
    ids = list(range(100, 110))
    runner = Runner(ours)
    runner.cache.hold_features(3 * ours.config.hidden_size, torch.float32)
    _, aux = runner.run(ids, torch.arange(10), 10, capture=(2, 3, 6))
    # the forward also stored them in the cache, each token's at its slot (pages out of order)
    assert torch.equal(runner.cache.features[runner.table.slots(range(10))], aux)
    assert not runner.cache.features[:3 * 4].any()  # the pages the table does not hold
    with torch.inference_mode():
        hs = theirs(torch.tensor([ids]), output_hidden_states=True).hidden_states
    # transformers' hidden_states[i] is the input of layer i (and [N] the last, pre-norm... normed)
    h = ours.config.hidden_size
    torch.testing.assert_close(aux[:, :h], hs[2][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(aux[:, h:2 * h], hs[3][0], atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_keeps_high_and_scales_low_frequencies():
    base = RopeConfig(theta=500000.0)
    scaled = RopeConfig(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position=8192)
    a, b = rope_inv_freq(base, 128), rope_inv_freq(scaled, 128)
    assert torch.equal(a[:10], b[:10])                     # short wavelengths untouched
    torch.testing.assert_close(b[-5:], a[-5:] / 8.0)       # long wavelengths divided by factor


def test_unsupported_configs_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        RopeConfig.from_hf({"rope_scaling": {"rope_type": "yarn", "factor": 2}})
    with pytest.raises(ValueError, match="not a Llama"):
        LlamaConfig.from_hf({"model_type": "mistral"})


def test_a_config_without_a_shape_or_with_a_wrong_one_is_refused_naming_the_file(tmp_path):
    """A config.json that lacks a shape key, gives one that is not a positive whole number,
    or gives heads that do not divide, is refused with the file and the key named (not a
    bare KeyError from deep in the loader)."""
    import json

    shape = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
             "num_hidden_layers": 2, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"config.json lacks vocab_size, hidden_size, "
                                         r"intermediate_size, num_hidden_layers, num_attention_heads"):
        LlamaConfig.read(tmp_path)
    assert str(tmp_path) in str(pytest.raises(ValueError, LlamaConfig.read, tmp_path).value)
    for key, value in (("hidden_size", "8"), ("num_hidden_layers", 0), ("vocab_size", 2.5),
                       ("intermediate_size", True), ("num_key_value_heads", -1)):
        with pytest.raises(ValueError, match=f"{key} must be a positive whole number, not "):
            LlamaConfig.from_hf({**shape, key: value})
    with pytest.raises(ValueError, match="num_attention_heads 2 is not a multiple of "
                                         "num_key_value_heads 3"):
        LlamaConfig.from_hf({**shape, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="hidden_size 8 is not a multiple of num_attention_heads 3"):
        LlamaConfig.from_hf({**shape, "num_attention_heads": 3})
    cfg = LlamaConfig.from_hf({**shape, "num_attention_heads": 3, "head_dim": 4,
                               "num_hidden_layers": 2.0})  # (JSON may write 2 as 2.0)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (3, 3, 4, 2)
    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON: Expecting"):
        LlamaConfig.read(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json holds a JSON list, not an object"):
        LlamaConfig.read(tmp_path)
    head = {**shape, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"]}
    del head["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(head))
    with pytest.raises(ValueError, match=r"config.json lacks intermediate_size: a Llama config"):
        Eagle3Config.read(tmp_path)


def test_a_head_whose_vocabulary_map_is_missing_or_out_of_range_is_refused(tmp_path):
    """A head drafting from fewer ids than the target's, without d2t, would propose the
    first ids of the target's vocabulary; one whose d2t maps past the vocabulary would have
    its trees rejected by the target. Both are load errors; a missing t2d (read only by
    training) is rebuilt."""
    import shutil

    from safetensors.torch import load_file, save_file

    from splitspec.builtin import BUILTIN_EAGLE3
    from splitspec.model.loader import load_eagle3

    tensors = load_file(BUILTIN_EAGLE3 / "model.safetensors")
    assert tensors["d2t"].numel() < tensors["t2d"].numel()  # a draft vocabulary of its own

    def head_with(name: str, **changes: torch.Tensor | None) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(BUILTIN_EAGLE3 / "config.json", folder / "config.json")
        kept = {k: changes.get(k, v) for k, v in tensors.items()}
        save_file({k: v for k, v in kept.items() if v is not None}, folder / "model.safetensors")
        return folder

    with pytest.raises(ValueError, match=r"drafts from 1024 ids \(draft_vocab_size\) of the "
                                         r"target's 2048 but has no d2t tensor"):
        load_eagle3(head_with("no_d2t", d2t=None), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"d2t maps draft ids to target ids \d+..2048, outside "
                                         r"the target's vocabulary of 2048"):
        far = tensors["d2t"].clone()
        far[-1] = 2048 - (far.numel() - 1)
        load_eagle3(head_with("far", d2t=far), torch.float32, "cpu")
    rebuilt = load_eagle3(head_with("no_t2d", t2d=None), torch.float32, "cpu")
    assert torch.equal(rebuilt.t2d, tensors["t2d"].bool())


def test_a_checkpoint_path_that_is_not_a_folder_is_said_so(tmp_path):
    """A mistyped --model is named as not a folder; a folder without config.json as that."""
    from splitspec.model.config import read_hf_config

    with pytest.raises(FileNotFoundError, match="nothere is not a folder: a checkpoint is a folder"):
        read_hf_config(tmp_path / "nothere")
    with pytest.raises(FileNotFoundError, match="config.json not found: a checkpoint folder needs"):
        read_hf_config(tmp_path)


def test_eagle3_aux_layer_convention():
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10}
    assert Eagle3Config.from_hf(cfg).aux_layer_inputs(32) == (2, 16, 29)
    explicit = {**cfg, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    # SGLang / SpecForge convention: ids name layer outputs, i.e. inputs of id + 1.
    assert Eagle3Config.from_hf(explicit).aux_layer_inputs(32) == (2, 16, 29)


def test_fused_projections_are_views_of_the_checkpoint_weights(models):
    """q/k/v and gate/up run as one GEMM each over a concatenated weight; the per-projection
    parameters (the state dict, what TP shards and tests read) are views of it, and the
    values are the checkpoint's."""
    from safetensors.torch import load_file

    ours, _ = models
    stored = {}
    for path in sorted(BUILTIN_TARGET.glob("*.safetensors")):
        stored.update(load_file(path))
    attn, mlp = ours.model.layers[1].self_attn, ours.model.layers[1].mlp
    assert attn.qkv is not None and mlp.gate_up is not None
    for name, param, fused in (("self_attn.q_proj", attn.q_proj.weight, attn.qkv),
                               ("self_attn.v_proj", attn.v_proj.weight, attn.qkv),
                               ("mlp.up_proj", mlp.up_proj.weight, mlp.gate_up)):
        assert param.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr(), name
        assert torch.equal(param, stored[f"model.layers.1.{name}.weight"].float()), name
    assert torch.equal(attn.qkv[-attn.v_proj.weight.shape[0]:], attn.v_proj.weight)
    with torch.no_grad():  # a change through the view reaches the fused GEMM
        attn.k_proj.weight[0, 0] += 1.0
        assert attn.qkv[attn.q_proj.weight.shape[0], 0] == attn.k_proj.weight[0, 0]
        attn.k_proj.weight[0, 0] -= 1.0


def test_fp8_weights_round_each_row_to_its_own_scale():
    """quantize_fp8: a row's largest magnitude maps to e4m3's 448, every weight is within
    e4m3's rounding (2^-4 of its size, or of the smallest normal's step below it), an all-zero
    row keeps scale 1, and ``full`` is the weight itself (no copy)."""
    from splitspec.kernels import FP8, fp8_linear_torch, quantize_fp8

    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    w[2] *= 1000.0  # rows of very different sizes: each gets its own scale
    w[4] = 0.0
    fp8 = quantize_fp8(w)
    assert fp8.codes.dtype == FP8 and fp8.scale.dtype == torch.float32
    assert fp8.full.data_ptr() == w.data_ptr()
    assert fp8.codes.float().abs().amax(dim=1).tolist() == [448.0] * 4 + [0.0, 448.0]
    assert fp8.scale[4] == 1.0
    back = fp8.codes.float() * fp8.scale[:, None]
    floor = 2.0 ** -9 * fp8.scale[:, None]  # e4m3's step below its smallest normal, 2^-6
    assert bool(((back - w).abs() <= w.abs() / 16 + floor).all())
    assert not torch.equal(back, w)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(fp8_linear_torch(x, fp8), x @ back.T, rtol=1e-5, atol=1e-4)


def test_quantized_projections_are_used_and_stay_close(models):
    """quantize_projections gives every projection of the target (attention, MLP, lm_head)
    its fp8 copy, and the forward then goes through them: the logits change, by less than
    the rounding's size, and the greedy token of most positions stays."""
    from splitspec.model.layers import quantize_projections

    ours, _ = models
    ids, pos = list(range(5, 37)), torch.arange(32)
    before, _ = Runner(ours).run(ids, pos, 32)
    model = load_llama(BUILTIN_TARGET, torch.float32, "cpu")
    layers = model.config.num_layers
    assert quantize_projections(model) == 4 * layers + 1
    assert set(model.model.layers[0].self_attn.fp8) == {"qkv", "o_proj"}
    assert set(model.model.layers[0].mlp.fp8) == {"gate_up", "down"}
    after, _ = Runner(model).run(ids, pos, 32)
    assert not torch.equal(before, after), "the fp8 weights were not used"
    change = (after - before).norm() / before.norm()
    assert change < 0.1, change
    agree = (after.argmax(-1) == before.argmax(-1)).float().mean()
    assert agree >= 0.9, agree


def test_quantizing_needs_the_fused_projections():
    from splitspec.model.layers import LlamaMLP, quantize_projections

    cfg = LlamaConfig.from_hf({"hidden_size": 16, "intermediate_size": 32,
                               "num_attention_heads": 2, "num_hidden_layers": 1,
                               "vocab_size": 8})
    with pytest.raises(ValueError, match="fuse_weights first"):
        quantize_projections(LlamaMLP(cfg))


def test_eos_ids_come_from_config_and_generation_config(tmp_path):
    """Llama-3-8B-Instruct's config.json names <|end_of_text|> alone and its
    generation_config.json adds <|eot_id|>, which ends every reply: Hugging Face's generate,
    vLLM and SGLang stop on both, so the target must too."""
    import json

    shape = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
             "num_hidden_layers": 2, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps({**shape, "eos_token_id": 5}))
    assert LlamaConfig.read(tmp_path).eos_token_ids == (5,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 5, 9]}))
    assert LlamaConfig.read(tmp_path).eos_token_ids == (5, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    assert LlamaConfig.read(tmp_path).eos_token_ids == (5,)
    for bad in ('{"eos_token_id": "9"}', '{"eos_token_id": [9, -1]}', "[9]"):
        (tmp_path / "generation_config.json").write_text(bad)
        with pytest.raises(ValueError, match="generation_config.json"):
            LlamaConfig.read(tmp_path)
    with pytest.raises(ValueError, match="config.json: eos_token_id must be a token id or a "
                                         r"list of them, not \[1, True\]"):
        LlamaConfig.from_hf({**shape, "eos_token_id": [1, True]}, "config.json")
