"""The ``splitspec`` command: ``up`` (the stack as local processes), ``generate``, ``status``,
``train-draft`` (an EAGLE-3 head for any Llama-architecture target).

    splitspec up                         # draft, target and gateway on the built-in models
    splitspec up --generate "Once upon"  # start, stream one completion, stop
    splitspec generate "Once upon a time" --max-new-tokens 32 --stop "."
    splitspec status
    splitspec train-draft --target ckpt/ --corpus code/ --out head/ --device cuda
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.policy import describe_policy
from splitspec.builtin import BUILTIN_DRAFT, BUILTIN_EAGLE3, BUILTIN_TARGET
from splitspec.grpc_server import CHANNEL_OPTIONS
from splitspec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

SPECULATION_MODES = {
    "auto": common_pb2.SPECULATION_MODE_AUTO,
    "on": common_pb2.SPECULATION_MODE_ON,
    "off": common_pb2.SPECULATION_MODE_OFF,
}
DRAFT_KINDS = ("eagle3", "standalone", "none")
STOP_GRACE_S = 5.0  # after SIGTERM, before SIGKILL: the target and the draft
UP_DRAIN_S = 10.0  # the gateway's --drain-timeout-s under `up`: Ctrl-C waits this long at most
GATEWAY_STOP_S = UP_DRAIN_S + 5.0  # its drain, its server's grace, then SIGKILL
UP_GENERATE_TIMEOUT_S = 600.0  # `up --generate`: a stuck stack stops rather than waits


# --- generate ------------------------------------------------------------------------------

@dataclass(frozen=True)
class CompletionRequest:
    text: str
    max_new_tokens: int | None
    speculation: str
    stop: tuple[str, ...]
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0            # 0: off
    top_p: float = 0.0        # 0 or 1: off
    seed: int | None = None   # None: the target draws one
    add_special_tokens: bool = True  # False: the text alone, as it holds its own BOS

    @classmethod
    def from_args(cls, args: argparse.Namespace, text: str,
                  stop: Sequence[str] = ()) -> CompletionRequest:
        return cls(text, args.max_new_tokens, args.speculation, tuple(stop), args.temperature,
                   args.top_k, args.top_p, args.seed, args.add_special_tokens)

    def to_pb(self) -> gateway_pb2.GenerateRequest:
        request = gateway_pb2.GenerateRequest(text=self.text,
                                              speculation=SPECULATION_MODES[self.speculation])
        if self.max_new_tokens is not None:
            request.stopping.max_new_tokens = self.max_new_tokens
        request.stopping.stop.extend(self.stop)
        request.sampling.temperature = self.temperature
        request.sampling.top_k = self.top_k
        request.sampling.top_p = self.top_p
        if self.seed is not None:
            request.sampling.seed = self.seed
        if not self.add_special_tokens:
            request.add_special_tokens = False
        return request


def format_final(final: gateway_pb2.GenerateResponse) -> str:
    """The finish reason, usage, timings and speculation figures of a last message."""
    usage, timings, spec = final.usage, final.timings, final.spec
    decode_s = timings.total_s - timings.time_to_first_token_s
    rate = (usage.completion_tokens - 1) / decode_s if decode_s > 0 and usage.completion_tokens > 1 else 0
    reason = common_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_")
    return "\n".join([
        f"finish: {reason}   prompt {usage.prompt_tokens} tokens, "
        f"completion {usage.completion_tokens} tokens",
        f"timings: queue {timings.queue_s:.3f}s, first token {timings.time_to_first_token_s:.3f}s, "
        f"total {timings.total_s:.3f}s ({rate:.1f} tokens/s after the first)",
        f"speculation: {format_spec(spec)}",
    ])


def format_spec(spec: common_pb2.SpecStats) -> str:
    """Speculation statistics in one line, with the acceptance rate at each tree depth."""
    by_depth = " ".join(f"{rate:.2f}" for rate in spec.acceptance_by_depth) or "-"
    return (f"{spec.verify_steps} verify steps, {spec.drafted_tokens} drafted, "
            f"{spec.accepted_tokens} accepted, mean accepted length {spec.mean_accepted_length:.2f}, "
            f"{spec.plain_steps} plain steps, {spec.rejected_trees} rejected trees; "
            f"acceptance by depth: {by_depth}")


def rpc_failure(exc: grpc.RpcError, address: str, timeout_s: float | None) -> str:
    """A failed call to the gateway in one line, with what to check where that is clear."""
    hint = ""
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout_s is not None:
        hint = f" (no answer within the deadline, {timeout_s:g} s)"
    elif exc.code() == grpc.StatusCode.UNAVAILABLE:
        hint = f" (is a gateway serving at {address}? `splitspec up` starts one)"
    return f"splitspec: {exc.code().name}: {exc.details()}{hint}"


def stream_completion(address: str, request: CompletionRequest, timeout_s: float | None = None,
                      out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Stream one completion to ``out`` (stdout) and its statistics to ``err`` (stderr);
    return an exit code. ``timeout_s`` is the call's deadline (None: none): past it the
    gateway cancels the request and the text so far stays printed (exit code 1); so does
    Ctrl-C (130)."""
    out = out or sys.stdout
    err = err or sys.stderr
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        final = None
        streamed = ""  # a line break before a message, once text has been printed
        call = stub.GenerateStream(request.to_pb(), timeout=timeout_s)
        try:
            for response in call:
                out.write(response.text)
                out.flush()
                streamed = streamed or ("\n" if response.text else "")
                if response.finish_reason:
                    final = response
        except grpc.RpcError as exc:  # the command's result: printed, exit code 1
            print(f"{streamed}{rpc_failure(exc, address, timeout_s)}", file=err)
            return 1
        except KeyboardInterrupt:  # Ctrl-C: the command's result, as a shell's (128 + SIGINT)
            call.cancel()  # (the gateway cancels the request at the target)
            print(f"{streamed}splitspec: interrupted: the request was cancelled", file=err)
            return 128 + signal.SIGINT
    out.write("\n")
    out.flush()  # (before the statistics on err, where both go to one terminal or file)
    if final is None:
        print("splitspec: the stream ended without a final message", file=err)
        return 1
    print(f"--- {format_final(final)}", file=err)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    request = CompletionRequest.from_args(args, text, args.stop)
    return stream_completion(args.address, request, timeout_s=args.timeout_s)


# --- status --------------------------------------------------------------------------------

def format_report(report: common_pb2.InitReport, title: str) -> list[str]:
    """An init report as a table of step / state / duration / detail (ranks indented)."""
    if not report.service:
        return [f"{title}: no report"]
    state = "ok" if report.ok else "FAILED"
    lines = [f"{title} ({report.service} rank {report.rank}): {state}",
             f"  {'step':<24} {'state':<8} {'duration':>9}  detail"]
    for step in report.steps:
        name = common_pb2.StepState.Name(step.state).removeprefix("STEP_STATE_")
        detail = step.detail or (f"{step.error_type}: {step.error_message}" if step.error_type else "")
        lines.append(f"  {step.name:<24} {name:<8} {step.duration_s:>8.2f}s  {detail}")
    for rank in report.ranks:
        lines.extend("  " + line for line in format_report(rank, f"rank {rank.rank}"))
    return lines


def format_status(status: gateway_pb2.StatusResponse) -> str:
    step, spec = status.last_step, status.spec
    lines = [
        f"model: {status.model_name or '-'}   running: {status.running}   queued: {status.queued}"
        f"   speculating: {'yes' if status.speculating else 'no'}",
        f"policy: {describe_policy(status.policy)}",
        f"speculation since start: {format_spec(spec)}",
        f"last step: #{step.step} batch {step.batch_size}, prefill {step.prefill_tokens} tokens, "
        f"drafted {step.drafted_tokens}, accepted {step.accepted_tokens}, draft "
        f"{step.draft_s * 1e3:.1f}ms, forward {step.forward_s * 1e3:.1f}ms, total "
        f"{step.total_s * 1e3:.1f}ms, waiting {step.waiting}",
        "",
    ]
    for report, title in ((status.gateway, "gateway"), (status.target, "target"),
                          (status.draft, "draft")):
        lines.extend(format_report(report, title))
        lines.append("")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    with grpc.insecure_channel(args.address, options=CHANNEL_OPTIONS) as channel:
        try:
            status = gateway_pb2_grpc.GatewayStub(channel).GetStatus(
                gateway_pb2.GetStatusRequest(), timeout=args.timeout_s)
        except grpc.RpcError as exc:  # the command's result: printed, exit code 1
            print(rpc_failure(exc, args.address, args.timeout_s), file=sys.stderr)
            return 1
    print(format_status(status))
    return 0


# --- up ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChildSpec:
    """One service to run: its name and its command line."""

    name: str
    argv: tuple[str, ...]


def stack_specs(args: argparse.Namespace) -> list[ChildSpec]:
    """The services of ``splitspec up``, in start order (draft, target, gateway)."""
    python = sys.executable
    specs = []
    target_argv = [python, "-m", "target_service", "--port", str(args.target_port)]
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    placed = ([] if args.device == "cpu" else ["--device", args.device]) + (
        [] if dtype == "float32" else ["--dtype", dtype])  # the services' defaults: cpu, float32
    if args.draft_kind != "none":
        default_draft = BUILTIN_EAGLE3 if args.draft_kind == "eagle3" else BUILTIN_DRAFT
        draft_model = args.draft_model or default_draft
        draft_argv = [python, "-m", "draft_service", "--port", str(args.draft_port), *placed]
        if args.draft_model or args.draft_kind != "eagle3":
            draft_argv += ["--model", str(draft_model)]
        if args.draft_model:  # (a built-in draft knows its target: the built-in one)
            # the target's layer count and tokenizer, and a head's embedding where it has none
            draft_argv += ["--target-model", str(args.target_model or BUILTIN_TARGET)]
        if args.draft_quantize != "none":
            draft_argv += ["--quantize", args.draft_quantize]
        specs.append(ChildSpec("draft", tuple(draft_argv + args.draft_flag)))
        target_argv += ["--draft", f"localhost:{args.draft_port}"]
    gateway_argv = [python, "-m", "gateway", "--port", str(args.gateway_port),
                    "--target", f"localhost:{args.target_port}", "--drain-timeout-s", f"{UP_DRAIN_S:g}"]
    if args.target_model:
        target_argv += ["--model", str(args.target_model)]
        gateway_argv += ["--model", str(args.target_model)]
    specs.append(ChildSpec("target", tuple(target_argv + placed + args.target_flag)))
    specs.append(ChildSpec("gateway", tuple(gateway_argv + args.gateway_flag)))
    return specs


class StopRequested(Exception):
    """SIGTERM (or SIGINT) asked ``splitspec up`` to stop the stack."""


class ServiceDied(Exception):
    """A child service exited while the stack should be running."""

    def __init__(self, name: str, returncode: int) -> None:
        super().__init__(f"the {name} service exited with code {returncode}; its init report "
                         f"and error are in its output above")
        self.name = name


class Child:
    """A running service process whose output is copied, prefixed with its name, to stderr
    (held back, in order, while :meth:`holding_output`)."""

    _print_lock = threading.Lock()
    _held: list[str] | None = None  # every child's lines kept back, while held

    def __init__(self, spec: ChildSpec) -> None:
        self.name = spec.name
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Its own process group: Ctrl-C reaches only `splitspec up`, which stops children in order.
        self.proc = subprocess.Popen(spec.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, errors="replace", env=env, process_group=0)
        self._pump = threading.Thread(target=self._copy_output, name=f"{self.name}-output",
                                      daemon=True)
        self._pump.start()

    def _copy_output(self) -> None:
        assert self.proc.stdout is not None, "started with stdout=PIPE"
        for line in self.proc.stdout:
            with self._print_lock:
                if Child._held is not None:
                    Child._held.append(f"{self.name:>7} | {line}")
                else:
                    sys.stderr.write(f"{self.name:>7} | {line}")
                    sys.stderr.flush()

    @classmethod
    @contextmanager
    def holding_output(cls) -> Iterator[None]:
        """Keep every child's output back while a completion streams to the terminal (their
        log lines broke into its text), and print it after, in order."""
        with cls._print_lock:
            cls._held = []
        try:
            yield
        finally:
            with cls._print_lock:
                held, cls._held = cls._held or [], None
                if held:
                    sys.stderr.write("splitspec up: the services' output while it streamed:\n")
                    sys.stderr.writelines(held)
                    sys.stderr.flush()

    def check_alive(self) -> None:
        """Raise ServiceDied when the process has exited."""
        if self.proc.poll() is not None:
            self._pump.join(timeout=2.0)
            raise ServiceDied(self.name, self.proc.returncode)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def wait_or_kill(self, deadline: float) -> None:
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # did not stop on SIGTERM: killed
            print(f"splitspec up: {self.name} ignored SIGTERM; killing it", file=sys.stderr)
            self.proc.kill()
            self.proc.wait()
        self._pump.join(timeout=2.0)


def stop_all(children: Sequence[Child]) -> None:
    """SIGTERM the gateway and wait while it drains (requests in flight finish, up to
    UP_DRAIN_S), then SIGTERM the others and wait; SIGKILL what outlives its deadline."""
    gateway = [child for child in children if child.name == "gateway"]
    rest = [child for child in reversed(children) if child.name != "gateway"]
    for group, grace_s in ((gateway, GATEWAY_STOP_S), (rest, STOP_GRACE_S)):
        for child in group:
            child.terminate()
        deadline = time.monotonic() + grace_s
        for child in group:
            child.wait_or_kill(deadline)


def wait_until_serving(address: str, children: Sequence[Child], timeout_s: float) -> None:
    """Poll the gateway's health until SERVING; raise ServiceDied or TimeoutError."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            for child in children:
                child.check_alive()
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
            except grpc.RpcError:  # not listening yet: poll again
                status = health_pb2.HealthCheckResponse.UNKNOWN
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway at {address} was not SERVING within {timeout_s:.0f}s")
            time.sleep(0.2)


def watch(children: Sequence[Child]) -> None:
    """Return only by raising: ServiceDied when a child exits (or StopRequested by signal)."""
    while True:
        for child in children:
            child.check_alive()
        time.sleep(0.2)


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise StopRequested(signal.Signals(signum).name)


def up_input_error(args: argparse.Namespace) -> str:
    """What is wrong with ``up``'s checkpoint folders, in its own flags' names, or "".
    Said before anything starts (the services would refuse the same, naming theirs):
    a --target-model that is not a checkpoint with a tokenizer, a --draft-model that is
    not a checkpoint, or a target whose tokenizer the built-in draft was not trained on."""
    from splitspec.tokenizer import TOKENIZER_FILE, tokenizer_sha256

    target = args.target_model
    needs = {"--target-model": ("config.json", TOKENIZER_FILE), "--draft-model": ("config.json",)}
    for flag, folder in (("--target-model", target), ("--draft-model", args.draft_model)):
        if folder is None or (flag == "--draft-model" and args.draft_kind == "none"):
            continue
        if not Path(folder).is_dir():
            return f"{flag} {folder} is not a folder"
        lacking = [name for name in needs[flag] if not (Path(folder) / name).is_file()]
        if lacking:
            return f"{flag} {folder} is not a checkpoint folder: it has no {', '.join(lacking)}"
    if (target is None or args.draft_model is not None or args.draft_kind == "none"
            or tokenizer_sha256(target) == tokenizer_sha256(BUILTIN_TARGET)):
        return ""
    return (f"--target-model {target} has a tokenizer of its own, and the built-in "
            f"{args.draft_kind} draft fits only the built-in target: pass --draft-model <a draft "
            f"for {target}> (`splitspec train-draft` trains an EAGLE-3 head for it), or "
            f"--draft-kind none")


def cmd_up(args: argparse.Namespace) -> int:
    problem = up_input_error(args)
    if problem:
        print(f"splitspec up: {problem}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    children: list[Child] = []
    gateway_address = f"localhost:{args.gateway_port}"
    try:
        for spec in stack_specs(args):
            print(f"splitspec up: starting {spec.name}: {' '.join(spec.argv)}", file=sys.stderr)
            children.append(Child(spec))
        wait_until_serving(gateway_address, children, args.startup_timeout_s)
        if args.generate is not None:
            request = CompletionRequest.from_args(args, args.generate)
            with Child.holding_output():  # (from before the SERVING line: none lands after it)
                print(f"splitspec up: SERVING at {gateway_address}", file=sys.stderr)
                return stream_completion(gateway_address, request,
                                         timeout_s=args.generate_timeout_s)
        print(f"splitspec up: SERVING at {gateway_address}", file=sys.stderr)
        watch(children)
    except StopRequested as exc:  # the way out of `up`: stop the stack cleanly
        print(f"splitspec up: {exc}: stopping the gateway (requests in flight get up to "
              f"{UP_DRAIN_S:g} s), then the others", file=sys.stderr)
        return 0
    except (ServiceDied, TimeoutError) as exc:  # the command's failure: printed, exit code 1
        print(f"splitspec up: {exc}; stopping the others", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_all(children)
    return 0


# --- train-draft -----------------------------------------------------------------------------

class TrainDraftError(Exception):
    """An input of ``train-draft`` that cannot work; the message says what to change."""


def train_draft(args: argparse.Namespace) -> int:
    """Tokenize the corpus with the target's tokenizer, pack it, train and write the head."""
    import torch

    from splitspec.training import data
    from splitspec.training.eagle3 import Eagle3TrainConfig, train_eagle3

    target, corpus_dir = args.target, args.corpus
    for name in ("config.json", "tokenizer.json"):
        if not (target / name).is_file():
            raise TrainDraftError(f"--target {target} is not a checkpoint folder: it has no {name}")
    if not corpus_dir.is_dir():
        raise TrainDraftError(f"--corpus {corpus_dir} does not exist or is not a folder")
    if args.draft_vocab_size < 0:
        raise TrainDraftError(f"--draft-vocab-size must be 0 (the target's vocabulary) or more, "
                              f"got {args.draft_vocab_size}")
    if args.device is not None:
        from splitspec.model.loader import check_device

        try:
            check_device(args.device)
        except ValueError as exc:  # before the corpus is read: the command's failure
            raise TrainDraftError(str(exc)) from exc
    from splitspec.model.config import LlamaConfig, read_hf_config

    try:
        config = read_hf_config(target)
        eos_ids = LlamaConfig.from_hf(config, str(target / "config.json")).eos_token_ids
    except ValueError as exc:  # before the corpus is read: the command's failure
        raise TrainDraftError(f"--target {target}: {exc}") from exc
    if not eos_ids:
        raise TrainDraftError(f"{target}/config.json has no eos_token_id; add the id that ends a "
                              f"document (it separates corpus files in the training blocks)")
    eos_id = eos_ids[0]  # (the first one when config.json lists several)
    try:
        corpus = data.collect_corpus([data.folder_source(corpus_dir)], args.max_corpus_bytes)
    except ValueError as exc:  # nothing readable: the command's failure, said plainly
        raise TrainDraftError(f"--corpus {corpus_dir} is empty: {exc}") from exc
    docs = data.tokenize(data.load_tokenizer(target), corpus.texts)
    block_len = min(args.block_len, config.get("max_position_embeddings", args.block_len))
    num_tokens = sum(len(ids) + 1 for ids in docs)
    if num_tokens < block_len:
        raise TrainDraftError(f"--corpus {corpus_dir} has {num_tokens} tokens, fewer than one "
                              f"block of {block_len}: add files or lower --block-len")
    blocks = data.pack_ids(docs, block_len, eos_id)
    print(f"splitspec train-draft: {len(corpus.files)} files, {num_tokens} tokens, "
          f"{len(blocks)} blocks of {block_len}", file=sys.stderr)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = Eagle3TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                            ttt_steps=args.ttt_steps, seed=args.seed, device=device,
                            draft_vocab_size=args.draft_vocab_size)
    result = train_eagle3(target, blocks, args.out, cfg,
                          data.count_tokens(docs, config["vocab_size"]))
    accuracy = " ".join(f"{a:.3f}" for a in result.step_accuracy)
    print(f"wrote an EAGLE-3 head to {result.out_dir} (final loss {result.final_loss:.3f}, "
          f"top-1 agreement with the target by step: {accuracy})\n"
          f"serve it with SplitSpec:\n"
          f"  splitspec up --target-model {target} --draft-model {result.out_dir}\n"
          f"or service by service:\n"
          f"  python -m draft_service --model {result.out_dir} --target-model {target}\n"
          f"  python -m target_service --model {target} --draft localhost:50053\n"
          f"or with SGLang / vLLM (the same folder):\n"
          f"  python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
          f"--speculative-draft-model-path {result.out_dir}\n"
          f"  vllm serve {target} --speculative-config "
          f"'{{\"method\": \"eagle3\", \"model\": \"{result.out_dir}\", "
          f"\"num_speculative_tokens\": 3}}'")
    return 0


def cmd_train_draft(args: argparse.Namespace) -> int:
    try:
        return train_draft(args)
    except TrainDraftError as exc:  # the command's failure: printed, exit code 2
        print(f"splitspec train-draft: {exc}", file=sys.stderr)
        return 2


def cmd_trace_summary(args: argparse.Namespace) -> int:
    from splitspec.trace_summary import main_summary

    if not args.spans.is_file():
        print(f"splitspec trace-summary: {args.spans} is not a file", file=sys.stderr)
        return 2
    try:
        print(main_summary(args.spans, args.json))
    except ValueError as exc:  # the command's failure: printed, exit code 2
        print(f"splitspec trace-summary: {exc}", file=sys.stderr)
        return 2
    return 0


# --- parser --------------------------------------------------------------------------------

class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None and empty ones (their help says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        shown = action.default is not None and action.default != []
        return super()._get_help_string(action) if shown else action.help


def _whole_number(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high], or a usage error naming the flag
    (a value the request's field cannot hold would otherwise end in a traceback)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as exc:  # argparse's usage error, naming the flag
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from exc
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low} (got {text})")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high} (got {text})")
        return value
    return parse


def _add_sampling_flags(parser: argparse.ArgumentParser, what: str) -> None:
    """--temperature, --top-k, --top-p and --seed for ``what`` (the gateway checks ranges)."""
    parser.add_argument("--temperature", type=float, default=0.0,
                        help=f"sampling temperature for {what}; 0 = greedy")
    parser.add_argument("--top-k", type=_whole_number(0, 2**31 - 1), default=0,
                        help="sample from the k most likely tokens only; 0 = off")
    parser.add_argument("--top-p", type=float, default=0.0,
                        help="sample from the smallest set of tokens whose probability reaches "
                             "p; 0 or 1 = off")
    parser.add_argument("--seed", type=_whole_number(0, 2**64 - 1), default=None,
                        help="fixes the sampling's random stream: the same request gives the "
                             "same text for a given speculation mode (default: the target "
                             "draws one)")


def _add_prompt_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--no-special-tokens", dest="add_special_tokens", action="store_false",
                        help=f"tokenize {what} alone, without the special tokens its tokenizer "
                             "adds (a Llama checkpoint's BOS): for a prompt that already holds "
                             "them")


def _deadline(text: str) -> float | None:
    """A --timeout-s value: seconds, where 0 means no deadline."""
    try:
        seconds = float(text)
    except ValueError as exc:  # argparse's usage error, naming the flag
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from exc
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 (got {text})")
    return seconds or None


def build_parser() -> argparse.ArgumentParser:
    formatter = _Formatter
    parser = argparse.ArgumentParser(prog="splitspec", formatter_class=formatter,
                                     description="SplitSpec: speculative decoding as gateway, "
                                                 "target and draft gRPC services.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = commands.add_parser("up", formatter_class=formatter,
                             help="run draft, target and gateway as local processes",
                             description="Start the three services, print their output prefixed "
                                         "with their names (on stderr) and wait until the gateway "
                                         "is SERVING; Ctrl-C or SIGTERM stops them all: the "
                                         "gateway first, after requests in flight finish (up "
                                         f"to {UP_DRAIN_S:g} s).")
    up.add_argument("--gateway-port", type=int, default=50051, help="gateway port (client-facing)")
    up.add_argument("--target-port", type=int, default=50052, help="target service port")
    up.add_argument("--draft-port", type=int, default=50053, help="draft service port")
    up.add_argument("--draft-kind", choices=DRAFT_KINDS, default="eagle3",
                    help="eagle3: the built-in EAGLE-3 head; standalone: the built-in small LM; "
                         "none: no draft service, no speculation")
    up.add_argument("--target-model", type=Path, default=None,
                    help=f"target checkpoint folder, also the gateway's tokenizer "
                         f"(default: {BUILTIN_TARGET})")
    up.add_argument("--draft-model", type=Path, default=None,
                    help="draft checkpoint folder (default: the built-in one of --draft-kind)")
    up.add_argument("--device", default="cpu",
                    help="torch device of the draft and the target (cpu, cuda, cuda:1, ...)")
    up.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="weights and activations dtype of the draft and the target (default: "
                         "float32 on cpu, else bfloat16)")
    up.add_argument("--draft-quantize", choices=("none", "fp8"), default="none",
                    help="the draft service's --quantize: fp8 keeps the draft's projections "
                         "also in fp8 (a GPU in bfloat16 or float16; see README)")
    for service, module, example in (("gateway", "gateway", "--spec-policy=static"),
                                     ("target", "target_service", "--defer-catch-up=16"),
                                     ("draft", "draft_service", "--cpu-threads=2")):
        up.add_argument(f"--{service}-flag", action="append", default=[], metavar="ARG",
                        help=f"one more argument for the {service}'s command line, after those "
                             f"up gives it (repeatable; e.g. --{service}-flag={example}; "
                             f"python -m {module} --help lists them)")
    up.add_argument("--startup-timeout-s", type=float, default=600.0,
                    help="give up when the gateway is not SERVING after this long")
    up.add_argument("--generate", metavar="TEXT", default=None,
                    help="once SERVING, stream one completion of TEXT, print its statistics, "
                         "then stop the stack")
    up.add_argument("--max-new-tokens", type=_whole_number(1, 2**32 - 1), default=64,
                    help="length limit for --generate")
    up.add_argument("--speculation", choices=SPECULATION_MODES, default="auto",
                    help="speculation mode for --generate")
    _add_sampling_flags(up, "--generate")
    _add_prompt_flag(up, "--generate's TEXT")
    up.add_argument("--generate-timeout-s", type=_deadline, default=UP_GENERATE_TIMEOUT_S,
                    help="--generate's deadline, from SERVING to its last token: past it the "
                         "stack stops and the command exits 1; 0 = none")
    up.set_defaults(func=cmd_up)

    gen = commands.add_parser("generate", formatter_class=formatter,
                              help="stream one completion from a running gateway",
                              description="Stream the completion to stdout as it arrives; the "
                                          "finish reason, usage, timings and speculation "
                                          "statistics follow on stderr.")
    gen.add_argument("text", help="the prompt; - reads it from stdin (a chat-templated or "
                                  "long prompt, with its newlines as they are)")
    gen.add_argument("--address", default="localhost:50051", help="gateway address")
    gen.add_argument("--max-new-tokens", type=_whole_number(1, 2**32 - 1), default=None,
                     help="length limit (default: the gateway's --default-max-new-tokens)")
    gen.add_argument("--speculation", choices=SPECULATION_MODES, default="auto",
                     help="auto: the gateway's policy; on: always; off: never")
    _add_sampling_flags(gen, "the completion")
    _add_prompt_flag(gen, "the prompt")
    gen.add_argument("--stop", action="append", default=[], metavar="S",
                     help="stop string (repeat for several); not included in the output")
    gen.add_argument("--timeout-s", type=_deadline, default=None,
                     help="the call's deadline: past it the gateway cancels the request and the "
                          "command exits 1, with the text so far printed (default or 0: none)")
    gen.set_defaults(func=cmd_generate)

    status = commands.add_parser("status", formatter_class=formatter,
                                 help="print the stack's init reports and live figures",
                                 description="Print GetStatus of a running gateway: the init "
                                             "reports of gateway, target and draft as tables, "
                                             "and the live figures.")
    status.add_argument("--address", default="localhost:50051", help="gateway address")
    status.add_argument("--timeout-s", type=float, default=10.0, help="RPC deadline")
    status.set_defaults(func=cmd_status)

    train = commands.add_parser(
        "train-draft", formatter_class=formatter,
        help="train an EAGLE-3 head for a Llama-architecture target",
        description="Tokenize every code / text file under --corpus (recursively, sorted) with "
                    "the target's tokenizer.json, pack them into blocks, train an EAGLE-3 head on "
                    "the target's features with the training-time-test loss, and write it to "
                    "--out in the format SGLang, vLLM and the SplitSpec draft service load.")
    train.add_argument("--target", type=Path, required=True,
                       help="target checkpoint folder (Hugging Face Llama: config.json, "
                            "*.safetensors, tokenizer.json)")
    train.add_argument("--corpus", type=Path, required=True, help="folder of training text / code")
    train.add_argument("--out", type=Path, required=True, help="folder the head is written to")
    train.add_argument("--draft-vocab-size", type=int, default=0,
                       help="draft vocabulary: the N most frequent corpus ids (d2t / t2d maps); "
                            "0 = the target's whole vocabulary")
    train.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    train.add_argument("--batch-size", type=int, default=16, help="blocks per step")
    train.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    train.add_argument("--block-len", type=int, default=512,
                       help="tokens per block (capped at the target's max_position_embeddings)")
    train.add_argument("--ttt-steps", type=int, default=4,
                       help="drafting steps unrolled in the training-time-test loss")
    train.add_argument("--max-corpus-bytes", type=int, default=256 * 2**20,
                       help="read corpus files (sorted) until this many bytes")
    train.add_argument("--device", choices=("cpu", "cuda"), default=None,
                       help="torch device (default: cuda when available, else cpu)")
    train.add_argument("--seed", type=int, default=0, help="random seed")
    train.set_defaults(func=cmd_train_draft)

    summary = commands.add_parser(
        "trace-summary", formatter_class=formatter,
        help="decode-latency breakdown from exported spans",
        description="Read spans exported as OTLP/JSON lines (the collector's file exporter, "
                    "e.g. the compose stack's spans.jsonl) and print, per speculation on/off and "
                    "batch size, percentiles of each decode step's draft exchange, verify "
                    "forward and bookkeeping time.")
    summary.add_argument("spans", type=Path, help="OTLP/JSON lines file")
    summary.add_argument("--json", action="store_true", help="print the rows as JSON")
    summary.set_defaults(func=cmd_trace_summary)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.func is cmd_up and args.draft_kind == "none" and args.draft_quantize != "none":
        parser.error("up: --draft-quantize needs a draft (--draft-kind is none)")
    if args.func is cmd_up and args.draft_kind == "none" and args.draft_flag:
        parser.error("up: --draft-flag needs a draft (--draft-kind is none)")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
