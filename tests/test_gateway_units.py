"""Unit tests of the gateway's pure parts: detokenizer, stop strings, validation,
policy, admission, config. Fast; no processes, no network."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gateway.admission import Admission
from gateway.config import GatewayConfig, build_parser
from gateway.policy import ANY_BATCH_SIZE, ShapeOverride, resolve_shape, static_policy
from gateway.text_stream import StopMatcher, TextStream
from gateway.validation import Limits, validate
from splitspec.builtin import BUILTIN_TARGET
from splitspec.grpc_server import ServiceError
from splitspec.tokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    ModelTokenizer,
    load_tokenizer,
    tokenizer_sha256,
)
from splitspec.v1 import common_pb2, gateway_pb2

MULTIBYTE_TEXTS = ["héllo 世界 🙂", "naïve café — 日本語のテキスト 🙂🙃 ok", "ü", "🙂"]


def _train_byte_level(folder: Path) -> Path:
    """A tiny byte-level BPE (as GPT-2 / Llama-3 use), trained on ASCII so multi-byte
    characters split into several byte tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    tokenizer.train_from_iterator(["hello world, the quick brown fox jumps"] * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    if (BUILTIN_TARGET / "tokenizer.json").is_file():
        return load_tokenizer(BUILTIN_TARGET)
    return load_tokenizer(_train_byte_level(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    return load_tokenizer(_train_byte_level(tmp_path_factory.mktemp("small")))


# --- tokenizer and incremental detokenization ---------------------------------------------

@pytest.fixture(scope="module")
def llama_like(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    """A tokenizer.json that adds a BOS, ``<s>``, through a post-processor, as a Llama
    checkpoint's does."""
    from tokenizers.processors import TemplateProcessing

    folder = _train_byte_level(tmp_path_factory.mktemp("llama_like"))
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    raw.add_special_tokens(["<s>"])
    bos = raw.token_to_id("<s>")
    raw.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    raw.save(str(folder / "tokenizer.json"))
    return load_tokenizer(folder)


def test_a_text_prompt_gets_the_bos_its_tokenizer_adds(llama_like: ModelTokenizer,
                                                      tokenizer: ModelTokenizer) -> None:
    """A Llama checkpoint's tokenizer.json adds its BOS through a post-processor, and
    the model expects it in front of a text prompt (Hugging Face, vLLM and SGLang add it
    by default); the built-in tokenizer has none, so its prompts are unchanged."""
    bos = llama_like.tokenizer.token_to_id("<s>")
    ids = llama_like.encode("hello world")
    bare = llama_like.tokenizer.encode("hello world", add_special_tokens=False).ids
    assert ids[0] == bos and ids[1:] == bare
    assert llama_like.encode("hello world", add_special_tokens=False) == bare
    assert llama_like.decode(ids) == "hello world"
    assert tokenizer.encode("def f(x):") == tokenizer.tokenizer.encode(
        "def f(x):", add_special_tokens=False).ids


def test_sha256_is_of_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes(b"abc")
    assert tokenizer_sha256(tmp_path) == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")


def test_load_tokenizer_names_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="nothere is not a folder: pass --model"):
        load_tokenizer(tmp_path / "nothere")  # (a mistyped path: said so, not "no tokenizer.json")


@pytest.mark.parametrize("which", ["tokenizer", "small_tokenizer"])
@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_detokenizer_one_token_at_a_time(request: pytest.FixtureRequest, which: str,
                                         text: str) -> None:
    tok: ModelTokenizer = request.getfixturevalue(which)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.finish())
    assert "".join(pieces) == text
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


@pytest.mark.parametrize("step", [2, 3, 5])
def test_detokenizer_several_tokens_per_push(small_tokenizer: ModelTokenizer, step: int) -> None:
    text = MULTIBYTE_TEXTS[1]
    ids = small_tokenizer.encode(text)
    detok = IncrementalDetokenizer(small_tokenizer)
    pieces = [detok.push(ids[i:i + step]) for i in range(0, len(ids), step)] + [detok.finish()]
    assert "".join(pieces) == text
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_detokenizer_holds_back_partial_character(small_tokenizer: ModelTokenizer) -> None:
    ids = small_tokenizer.encode("🙂")
    assert len(ids) > 1, "the emoji must span several byte tokens for this test"
    detok = IncrementalDetokenizer(small_tokenizer)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🙂"


def test_detokenizer_with_prompt_context(small_tokenizer: ModelTokenizer) -> None:
    prompt, completion = "hello", " world 世界"
    prompt_ids = small_tokenizer.encode(prompt)
    ids = small_tokenizer.encode(completion)
    detok = IncrementalDetokenizer(small_tokenizer, prompt_ids)
    out = "".join(detok.push([i]) for i in ids) + detok.finish()
    assert out == completion


def test_detokenizer_finish_releases_truncated_character(small_tokenizer: ModelTokenizer) -> None:
    ids = small_tokenizer.encode("a🙂")
    detok = IncrementalDetokenizer(small_tokenizer)
    emitted = "".join(detok.push([i]) for i in ids[:-1])
    assert emitted == "a"
    assert detok.finish().startswith(REPLACEMENT_CHAR)


# --- stop strings --------------------------------------------------------------------------

def _feed(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    out = []
    for piece in pieces:
        result = matcher.push(piece)
        out.append(result.text)
        if result.is_stopped:
            return out, True
    out.append(matcher.finish())
    return out, False


def test_stop_across_pieces_and_hold_back() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("hello S").text == "hello "  # "S" could start STOP: held
    assert matcher.push("T").text == ""
    result = matcher.push("OP and more")
    assert result == ("", True)
    assert matcher.push("ignored") == ("", True)


def test_stop_hold_back_released_when_not_a_match() -> None:
    out, is_stopped = _feed(StopMatcher(["STOP"]), ["ST", "ORE", " ST"])
    assert not is_stopped
    assert out == ["", "STORE", " ", "ST"]


def test_multiple_stop_strings_earliest_wins() -> None:
    out, is_stopped = _feed(StopMatcher(["world", "lo w"]), ["hello world"])
    assert is_stopped and "".join(out) == "hel"


def test_stop_at_very_start() -> None:
    out, is_stopped = _feed(StopMatcher(["\n\n", "Q:"]), ["Q", ": what"])
    assert is_stopped and out == ["", ""]


def test_stop_longest_partial_suffix_of_any_stop() -> None:
    matcher = StopMatcher(["abc", "bcd"])
    assert matcher.push("xab").text == "x"  # "ab" prefixes abc; "b" prefixes bcd: hold 2
    assert matcher.push("cd").text == ""  # "abc" matches first
    assert matcher.is_stopped


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher([""])


def test_text_stream_stop_counts_tokens_up_to_match(small_tokenizer: ModelTokenizer) -> None:
    ids = small_tokenizer.encode("hello world, the quick")
    stream = TextStream(small_tokenizer, (), ["world"])
    pieces = []
    for i in ids:
        piece = stream.push([i])
        pieces.append(piece.text)
        if piece.is_stopped:
            break
    assert "".join(pieces) == "hello "
    assert small_tokenizer.decode(stream.token_ids).endswith("world")
    assert stream.num_tokens < len(ids)
    assert stream.push(ids).text == "" and stream.num_tokens == len(stream.token_ids)


def test_text_stream_without_stop_is_full_decode(tokenizer: ModelTokenizer) -> None:
    text = MULTIBYTE_TEXTS[0]
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer, (), ["zzz"])
    out = "".join(stream.push(ids[i:i + 2]).text for i in range(0, len(ids), 2)) + stream.finish()
    assert out == text
    assert stream.num_tokens == len(ids)


def test_text_stream_finish_releases_held_text(small_tokenizer: ModelTokenizer) -> None:
    stream = TextStream(small_tokenizer, (), ["world!"])
    assert stream.push(small_tokenizer.encode("hello world")).text == "hello "
    assert stream.finish() == "world" and not stream.is_stopped


def test_text_stream_stop_across_multibyte(small_tokenizer: ModelTokenizer) -> None:
    ids = small_tokenizer.encode("ok 世界 done")
    stream = TextStream(small_tokenizer, (), ["界"])
    out = ""
    for i in ids:
        piece = stream.push([i])
        out += piece.text
        assert REPLACEMENT_CHAR not in piece.text
        if piece.is_stopped:
            break
    assert stream.is_stopped and out == "ok 世"


# --- validation ----------------------------------------------------------------------------

LIMITS = Limits(vocab_size=100, max_context=32, default_max_new_tokens=16)


def _request(**kwargs: object) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(**kwargs)
    if "text" not in kwargs and "token_ids" not in kwargs:
        request.token_ids.ids.extend([1, 2, 3])
    return request


def _invalid(request: gateway_pb2.GenerateRequest, tokenizer: ModelTokenizer,
             limits: Limits = LIMITS) -> str:
    with pytest.raises(ServiceError) as info:
        validate(request, limits, tokenizer)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.message


def _stopping(**kwargs: object) -> gateway_pb2.StoppingParams:
    return gateway_pb2.StoppingParams(**kwargs)


def test_valid_request(small_tokenizer: ModelTokenizer) -> None:
    request = _request(stopping=_stopping(max_new_tokens=5, stop=["x"], stop_token_ids=[7]),
                       speculation=common_pb2.SPECULATION_MODE_OFF, include_token_ids=True)
    got = validate(request, LIMITS, small_tokenizer)
    assert got.prompt_ids == (1, 2, 3) and got.max_new_tokens == 5
    assert got.stop == ("x",) and got.stop_token_ids == (7,) and got.include_token_ids
    assert got.speculation == common_pb2.SPECULATION_MODE_OFF


def test_text_gets_its_special_tokens_unless_the_request_says_not(
        llama_like: ModelTokenizer) -> None:
    """A text prompt that already holds its BOS asks for none to be added (it would have
    two); token_ids are used as given, so the field is refused there, not ignored."""
    limits = Limits(vocab_size=llama_like.vocab_size, max_context=32, default_max_new_tokens=4)
    bos = llama_like.tokenizer.token_to_id("<s>")
    bare = llama_like.tokenizer.encode("hello", add_special_tokens=False).ids
    for request, expected in (
            (gateway_pb2.GenerateRequest(text="hello"), [bos, *bare]),
            (gateway_pb2.GenerateRequest(text="hello", add_special_tokens=True), [bos, *bare]),
            (gateway_pb2.GenerateRequest(text="<s>hello", add_special_tokens=False), [bos, *bare]),
            (gateway_pb2.GenerateRequest(text="hello", add_special_tokens=False), bare)):
        assert list(validate(request, limits, llama_like).prompt_ids) == expected
    message = _invalid(_request(token_ids=gateway_pb2.TokenIds(ids=[1, 2]),
                                add_special_tokens=False), llama_like, limits)
    assert "add_special_tokens applies to a text prompt" in message


def test_default_max_new_tokens_fits_context(small_tokenizer: ModelTokenizer) -> None:
    got = validate(_request(token_ids=gateway_pb2.TokenIds(ids=[1] * 30)), LIMITS, small_tokenizer)
    assert got.max_new_tokens == 2
    assert validate(_request(), LIMITS, small_tokenizer).max_new_tokens == 16


@pytest.mark.parametrize("request_kwargs, message", [
    ({"text": ""}, "text is empty"),
    ({"token_ids": gateway_pb2.TokenIds()}, "token_ids is empty"),
    ({"token_ids": gateway_pb2.TokenIds(ids=[1, 100])}, "token_ids[1] = 100 is out of range"),
    ({"stopping": gateway_pb2.StoppingParams(max_new_tokens=0)}, "max_new_tokens is 0"),
    ({"stopping": gateway_pb2.StoppingParams(max_new_tokens=33)},
     "max_new_tokens 33 exceeds the target's max_context 32"),
    ({"stopping": gateway_pb2.StoppingParams(max_new_tokens=30)},
     "prompt length 3 + max_new_tokens 30 = 33 exceeds the target's max_context 32"),
    ({"token_ids": gateway_pb2.TokenIds(ids=[1] * 32)}, "the prompt has 32 tokens"),
    ({"stopping": gateway_pb2.StoppingParams(stop=["ok", ""])}, "stopping.stop[1] is empty"),
    ({"stopping": gateway_pb2.StoppingParams(stop_token_ids=[100])},
     "stopping.stop_token_ids[0] = 100 is out of range"),
    ({"speculation": 7}, "unknown speculation mode 7"),
    ({"sampling": common_pb2.SamplingParams(temperature=-1)}, "temperature must be a finite number >= 0"),
    ({"sampling": common_pb2.SamplingParams(temperature=float("nan"))}, "temperature must be a finite number >= 0"),
    ({"sampling": common_pb2.SamplingParams(temperature=float("inf"))}, "temperature must be a finite number >= 0"),
    ({"sampling": common_pb2.SamplingParams(top_p=1.5)}, "top_p must be in [0, 1]"),
    ({"sampling": common_pb2.SamplingParams(top_k=-2)}, "top_k must be >= 0"),
])
def test_invalid_requests(small_tokenizer: ModelTokenizer, request_kwargs: dict[str, object],
                          message: str) -> None:
    assert message in _invalid(_request(**request_kwargs), small_tokenizer)


def test_no_input(small_tokenizer: ModelTokenizer) -> None:
    assert "no input" in _invalid(gateway_pb2.GenerateRequest(), small_tokenizer)


def test_out_of_range_message_names_vocab(small_tokenizer: ModelTokenizer) -> None:
    message = _invalid(_request(token_ids=gateway_pb2.TokenIds(ids=[250])), small_tokenizer)
    assert "250" in message and "100 ids" in message


def test_sampling_parameters_are_valid_and_passed_on(small_tokenizer: ModelTokenizer) -> None:
    for sampling in (common_pb2.SamplingParams(top_p=1.0), common_pb2.SamplingParams(top_p=0.0),
                     common_pb2.SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3)):
        assert validate(_request(sampling=sampling), LIMITS, small_tokenizer).sampling == sampling


# --- policy --------------------------------------------------------------------------------

DEFAULT_SHAPE = common_pb2.DraftShape(num_draft_tokens=8, topk=4, num_steps=4)


def test_policy_threshold_zero_never_off() -> None:
    policy = static_policy(0, DEFAULT_SHAPE)
    assert len(policy.entries) == 1
    assert policy.entries[0].max_batch_size == ANY_BATCH_SIZE == 2**32 - 1
    assert policy.entries[0].shape == DEFAULT_SHAPE


def test_policy_threshold_positive() -> None:
    policy = static_policy(8, DEFAULT_SHAPE)
    assert [(e.max_batch_size, e.shape) for e in policy.entries] == [(8, DEFAULT_SHAPE)]


def test_policy_negative_threshold_rejected() -> None:
    with pytest.raises(ValueError):
        static_policy(-1, DEFAULT_SHAPE)


def test_shape_override_per_field() -> None:
    assert resolve_shape(ShapeOverride(), DEFAULT_SHAPE) == DEFAULT_SHAPE
    assert resolve_shape(ShapeOverride(num_draft_tokens=5, topk=1, num_steps=5), DEFAULT_SHAPE) == (
        common_pb2.DraftShape(num_draft_tokens=5, topk=1, num_steps=5))
    assert resolve_shape(ShapeOverride(topk=1), DEFAULT_SHAPE) == common_pb2.DraftShape(
        num_draft_tokens=8, topk=1, num_steps=4)


# --- admission -----------------------------------------------------------------------------

def test_admission_limits_and_fifo() -> None:
    admission = Admission(max_running=2, max_queued=2)
    running = [admission.enqueue(), admission.enqueue()]
    assert all(t.is_admitted for t in running)
    queued = [admission.enqueue(), admission.enqueue()]
    assert not any(t.is_admitted for t in queued)
    assert (admission.num_running, admission.num_queued) == (2, 2)
    with pytest.raises(ServiceError) as info:
        admission.enqueue()
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-running 2" in info.value.message and "--max-queued 2" in info.value.message
    admission.release(running[0])
    assert queued[0].is_admitted and not queued[1].is_admitted
    admission.release(running[0])  # idempotent
    assert (admission.num_running, admission.num_queued) == (2, 1)
    admission.release(running[1])
    assert queued[1].is_admitted


def test_admission_withdraw_queued() -> None:
    admission = Admission(max_running=1, max_queued=2)
    first, second, third = admission.enqueue(), admission.enqueue(), admission.enqueue()
    assert admission.withdraw(second)
    assert not admission.withdraw(first)  # admitted: left alone
    assert not admission.wait(second)
    admission.release(first)
    assert third.is_admitted and admission.num_queued == 0


def test_admission_wait_wakes_on_release() -> None:
    admission = Admission(max_running=1, max_queued=1)
    first, second = admission.enqueue(), admission.enqueue()
    results = []
    waiter = threading.Thread(target=lambda: results.append(admission.wait(second, 5.0)))
    waiter.start()
    admission.release(first)
    waiter.join(5.0)
    assert results == [True]


def test_admission_no_queue() -> None:
    admission = Admission(max_running=1, max_queued=0)
    first = admission.enqueue()
    with pytest.raises(ServiceError):
        admission.enqueue()
    admission.release(first)
    assert admission.enqueue().is_admitted


# --- config --------------------------------------------------------------------------------

def test_config_defaults_from_parser() -> None:
    config = GatewayConfig.from_args(build_parser().parse_args([]))
    assert config == GatewayConfig()
    assert config.address == "127.0.0.1:50051" and config.target == "localhost:50052"
    assert config.max_queued == 256 and config.default_max_new_tokens == 128
    assert config.spec_policy == "adaptive"  # static always-on was 0.62x OFF at 64 streams


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="--max-queued must be >= 0"):
        GatewayConfig(max_queued=-1)
    with pytest.raises(ValueError, match="--log-level"):
        GatewayConfig(log_level="LOUD")
    with pytest.raises(ValueError, match="different node counts"):
        GatewayConfig(spec_policy="adaptive", spec_adaptive_shapes="8/4/4,8/1/8")


@pytest.mark.parametrize(("fields", "flag"), [
    ({"spec_disable_batch_threshold": 8}, "--spec-disable-batch-threshold applies to --spec-policy static"),
    ({"spec_policy": "static", "spec_policy_table": "4:8"}, "--spec-policy-table applies to --spec-policy table"),
    ({"spec_policy": "static", "spec_adaptive_shapes": "3"},
     "--spec-adaptive-shapes applies to --spec-policy adaptive"),
])
def test_config_refuses_a_flag_its_policy_would_ignore(fields, flag) -> None:
    """The seed's --spec-disable-batch-threshold alone would have been ignored silently once
    adaptive became the default; each policy's own flag now needs that policy."""
    with pytest.raises(ValueError, match=flag):
        GatewayConfig(**fields)
    GatewayConfig(**{**fields, "spec_policy": flag.rsplit(" ", 1)[-1]})


def test_every_flag_has_help() -> None:
    for action in build_parser()._actions:
        assert action.help, action.dest
