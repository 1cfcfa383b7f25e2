"""Replay records: the target's own greedy continuations, for the replay draft.

A records file is JSON lines, one line per prompt::

    {"prompt": [token ids], "tokens": [the target's greedy continuation of the prompt]}

:func:`record` makes them through a running target's Serve stream with
speculation OFF, so the continuations come from exactly the engine (model,
device, dtype, tensor parallelism) that is then benchmarked with the replay
draft (``draft_service/replay.py``), which reads them back with
:func:`read_records`. From the command line::

    python -m target_service --model /models/llama-8b-shaped --port 50052 --device cuda --dtype bfloat16
    python -m splitspec.replay --target localhost:50052 --prompts prompts.jsonl \\
                               --max-new-tokens 256 --out records.jsonl

``prompts.jsonl`` holds one prompt per line: a JSON list of token ids, or a
JSON string that ``--tokenizer`` (a folder with ``tokenizer.json``) encodes.
Continuations ignore EOS, so each is ``--max-new-tokens`` long.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import grpc

from splitspec.grpc_server import CHANNEL_OPTIONS
from splitspec.tokenizer import load_tokenizer
from splitspec.v1 import common_pb2, target_pb2, target_pb2_grpc

SERVE_TIMEOUT_S = 900


class ReplayRecord(NamedTuple):
    prompt: list[int]  # token ids
    tokens: list[int]  # the target's greedy continuation of prompt

    @property
    def full(self) -> list[int]:
        """Prompt then continuation: the sequence the replay draft follows."""
        return self.prompt + self.tokens


def serve(address: str, prompts: Sequence[Sequence[int]], max_new: int, mode: int
          ) -> tuple[list[list[int]], list[target_pb2.StepStats]]:
    """Greedy continuations (EOS ignored) of all prompts on one Serve stream of the target at
    address, with speculation `mode`, and every step's statistics; RuntimeError when a
    request fails."""
    requests: queue.Queue = queue.Queue()
    for i, ids in enumerate(prompts):
        requests.put(target_pb2.ServeRequest(admit=target_pb2.Admit(
            request_id=i, prompt_ids=ids, max_new_tokens=max_new, ignore_eos=True,
            speculation=mode)))
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    steps: dict[int, target_pb2.StepStats] = {}
    done = 0
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = target_pb2_grpc.TargetStub(channel).Serve(iter(requests.get, None),
                                                        timeout=SERVE_TIMEOUT_S)
        for event in call:
            steps.setdefault(event.stats.step, event.stats)
            for delta in event.deltas:
                if delta.finish_reason == common_pb2.FINISH_REASON_ERROR:
                    raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
                out[delta.request_id].extend(delta.token_ids)
                done += bool(delta.finish_reason)
            if done == len(prompts):
                break
        call.cancel()
    requests.put(None)  # ends the request iterator, so gRPC's thread consuming it exits
    return [out[i] for i in range(len(prompts))], list(steps.values())


def record(address: str, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[ReplayRecord]:
    """The target's greedy continuation of every prompt, generated with speculation OFF."""
    outputs, _ = serve(address, prompts, max_new_tokens, common_pb2.SPECULATION_MODE_OFF)
    return [ReplayRecord(list(p), out) for p, out in zip(prompts, outputs, strict=True)]


def write_records(path: Path, records: Iterable[ReplayRecord]) -> None:
    with Path(path).open("w") as f:
        for rec in records:
            f.write(json.dumps({"prompt": rec.prompt, "tokens": rec.tokens}) + "\n")


def _token_list(value: object, key: str, vocab_size: int) -> list[int]:
    """value as a non-empty list of token ids in [0, vocab_size); ValueError saying what is wrong."""
    if not isinstance(value, list) or not value:
        raise ValueError(f'"{key}" must be a non-empty list of token ids')
    bad = next((t for t in value if isinstance(t, bool) or not isinstance(t, int)
                or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f'"{key}" holds {bad!r}, not a token id in [0, {vocab_size})')
    return value


def parse_record(line: str, vocab_size: int) -> ReplayRecord:
    """One line of a records file; ValueError saying what is wrong with it."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(obj, dict) or not {"prompt", "tokens"} <= obj.keys():
        raise ValueError('expected an object with "prompt" and "tokens"')
    return ReplayRecord(_token_list(obj["prompt"], "prompt", vocab_size),
                        _token_list(obj["tokens"], "tokens", vocab_size))


def read_records(path: Path, vocab_size: int) -> list[ReplayRecord]:
    """Every record of a records file (blank lines skipped); ValueError naming the file and
    the line when one is broken, or when the file holds none."""
    records = []
    with Path(path).open() as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(parse_record(line, vocab_size))
            except ValueError as exc:
                raise ValueError(f"{path} line {number}: {exc}") from exc
    if not records:
        raise ValueError(f"{path} holds no records (expected JSON lines of "
                         '{"prompt": [...], "tokens": [...]})')
    return records


def read_prompts(path: Path, tokenizer_dir: Path | None) -> list[list[int]]:
    """Prompts, one per line: a JSON list of token ids, or a JSON string encoded with the
    tokenizer of tokenizer_dir; ValueError naming the line when one is neither."""
    tokenizer = None
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {number}: not JSON ({exc.msg})") from exc
        if isinstance(value, str):
            if tokenizer_dir is None:
                raise ValueError(f"{path} line {number} is text: pass --tokenizer <folder with "
                                 "tokenizer.json> to encode it")
            tokenizer = tokenizer or load_tokenizer(tokenizer_dir)
            value = tokenizer.encode(value)
        if not isinstance(value, list) or not value or \
                not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            raise ValueError(f"{path} line {number}: expected a non-empty list of token ids or "
                             "a string")
        prompts.append(value)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splitspec.replay",
        description="Record a running target's greedy continuations (speculation OFF) of "
                    "prompts, as the records file of the replay draft (python -m draft_service "
                    "--kind replay --replay-file FILE).")
    parser.add_argument("--target", default="localhost:50052", help="target address host:port")
    parser.add_argument("--prompts", type=Path, required=True,
                        help="JSON lines: a list of token ids, or a string, per prompt")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="folder with the tokenizer.json that encodes text prompts")
    parser.add_argument("--max-new-tokens", type=int, default=256,
                        help="tokens generated per prompt (EOS ignored)")
    parser.add_argument("--out", type=Path, required=True, help="the records file to write")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    prompts = read_prompts(args.prompts, args.tokenizer)
    records = record(args.target, prompts, args.max_new_tokens)
    write_records(args.out, records)
    print(f"recorded {len(records)} continuations of {args.max_new_tokens} tokens from "
          f"{args.target} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
