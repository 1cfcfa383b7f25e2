"""Checks a client's GenerateRequest and turns it into a :class:`GenerationRequest`.

Every rejection is a ServiceError(INVALID_ARGUMENT) whose message says what is
wrong; nothing here changes gateway state, so a bad request leaves the gateway healthy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from splitspec.grpc_server import invalid
from splitspec.tokenizer import ModelTokenizer
from splitspec.v1 import common_pb2, gateway_pb2


@dataclass(frozen=True)
class Limits:
    """What the target accepts (from TargetInfo) and the gateway's default length."""

    vocab_size: int
    max_context: int
    default_max_new_tokens: int


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request. Invariants: prompt_ids is non-empty and every id (prompt and
    stop ids) is < vocab_size; 1 <= max_new_tokens; len(prompt_ids) + max_new_tokens <=
    max_context; stop strings are non-empty; sampling values are in range."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    speculation: int  # a common_pb2.SpeculationMode value
    include_token_ids: bool
    sampling: common_pb2.SamplingParams = field(default_factory=common_pb2.SamplingParams)


def validate(request: gateway_pb2.GenerateRequest, limits: Limits,
             tokenizer: ModelTokenizer) -> GenerationRequest:
    """Check ``request`` against ``limits``; raise ServiceError(INVALID_ARGUMENT) saying what is wrong."""
    check_sampling(request.sampling)
    check_speculation(request.speculation)
    prompt_ids = prompt_token_ids(request, tokenizer)
    check_ids("token_ids" if request.HasField("token_ids") else "tokenized text", prompt_ids,
              limits.vocab_size)
    stopping = request.stopping
    check_ids("stopping.stop_token_ids", stopping.stop_token_ids, limits.vocab_size)
    for i, stop in enumerate(stopping.stop):
        if not stop:
            raise invalid(f"stopping.stop[{i}] is empty: stop strings must have at least one character")
    max_new_tokens = resolve_max_new_tokens(stopping, len(prompt_ids), limits)
    return GenerationRequest(
        prompt_ids=tuple(prompt_ids),
        max_new_tokens=max_new_tokens,
        stop=tuple(stopping.stop),
        stop_token_ids=tuple(stopping.stop_token_ids),
        ignore_eos=stopping.ignore_eos,
        speculation=request.speculation,
        include_token_ids=request.include_token_ids,
        sampling=request.sampling,
    )


def prompt_token_ids(request: gateway_pb2.GenerateRequest, tokenizer: ModelTokenizer) -> list[int]:
    """The prompt as token ids: ``token_ids`` as given, or ``text`` tokenized, with the
    special tokens its tokenizer adds unless ``add_special_tokens`` is false."""
    which = request.WhichOneof("input")
    if which is None:
        raise invalid("the request has no input: set text or token_ids")
    if which == "token_ids":
        if request.HasField("add_special_tokens"):
            raise invalid("add_special_tokens applies to a text prompt; token_ids are used as "
                          "given: leave it unset")
        if not request.token_ids.ids:
            raise invalid("token_ids is empty: give at least one prompt token")
        return list(request.token_ids.ids)
    if not request.text:
        raise invalid("text is empty: give a prompt")
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
    ids = tokenizer.encode(request.text, add_special_tokens=add_special)
    if not ids:
        raise invalid(f"text {request.text[:40]!r} tokenizes to no tokens: give a longer prompt")
    return ids


def check_ids(what: str, ids: list[int] | tuple[int, ...], vocab_size: int) -> None:
    for position, token_id in enumerate(ids):
        if token_id >= vocab_size:
            raise invalid(f"{what}[{position}] = {token_id} is out of range: the target's "
                          f"vocabulary has {vocab_size} ids (0..{vocab_size - 1})")


def resolve_max_new_tokens(stopping: gateway_pb2.StoppingParams, prompt_len: int,
                           limits: Limits) -> int:
    """The request's max_new_tokens, or the default lowered to fit max_context."""
    if prompt_len >= limits.max_context:
        raise invalid(f"the prompt has {prompt_len} tokens but the target's max_context is "
                      f"{limits.max_context}: leave room for at least one new token")
    if not stopping.HasField("max_new_tokens"):
        return min(limits.default_max_new_tokens, limits.max_context - prompt_len)
    max_new_tokens = stopping.max_new_tokens
    if max_new_tokens == 0:
        raise invalid("max_new_tokens is 0: it must be >= 1 (or unset for the gateway's default)")
    if max_new_tokens > limits.max_context:
        raise invalid(f"max_new_tokens {max_new_tokens} exceeds the target's max_context "
                      f"{limits.max_context}")
    if prompt_len + max_new_tokens > limits.max_context:
        raise invalid(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} = "
                      f"{prompt_len + max_new_tokens} exceeds the target's max_context "
                      f"{limits.max_context}")
    return max_new_tokens


def check_speculation(mode: int) -> None:
    """proto3 keeps unknown enum values as ints: reject those."""
    if mode not in common_pb2.SpeculationMode.values():
        known = ", ".join(f"{name} ({value})" for name, value in common_pb2.SpeculationMode.items())
        raise invalid(f"unknown speculation mode {mode}: use one of {known}")


def check_sampling(sampling: common_pb2.SamplingParams) -> None:
    """Temperature >= 0 (0 = greedy), top_p in [0, 1] (0 or 1 = off), top_k >= 0 (0 = off)."""
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
        raise invalid(f"temperature must be a finite number >= 0 (got {sampling.temperature})")
    if not 0 <= sampling.top_p <= 1:
        raise invalid(f"top_p must be in [0, 1] (got {sampling.top_p})")
    if sampling.top_k < 0:
        raise invalid(f"top_k must be >= 0 (got {sampling.top_k})")
