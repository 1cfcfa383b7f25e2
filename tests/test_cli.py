"""The splitspec command: parser, the stack's command lines, output formatting."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from splitspec.builtin import BUILTIN_DRAFT, BUILTIN_TARGET
from splitspec.cli import (
    CompletionRequest,
    build_parser,
    cmd_up,
    format_final,
    format_report,
    main,
    stack_specs,
    up_input_error,
)
from splitspec.init_report import InitReport, StepRecord, StepState
from splitspec.v1 import common_pb2, gateway_pb2


def _specs(*flags: str) -> dict[str, list[str]]:
    args = build_parser().parse_args(["up", *flags])
    return {spec.name: list(spec.argv[1:]) for spec in stack_specs(args)}


def test_up_default_is_eagle3_on_default_ports() -> None:
    specs = _specs()
    assert list(specs) == ["draft", "target", "gateway"]
    assert specs["draft"] == ["-m", "draft_service", "--port", "50053"]
    assert specs["target"] == ["-m", "target_service", "--port", "50052", "--draft", "localhost:50053"]
    assert specs["gateway"] == ["-m", "gateway", "--port", "50051", "--target", "localhost:50052",
                                "--drain-timeout-s", "10"]


def test_up_standalone_and_ports() -> None:
    specs = _specs("--draft-kind", "standalone", "--draft-port", "7003", "--target-port", "7002",
                   "--gateway-port", "7001")
    assert specs["draft"] == ["-m", "draft_service", "--port", "7003", "--model", str(BUILTIN_DRAFT)]
    assert specs["target"][-2:] == ["--draft", "localhost:7003"]
    assert specs["gateway"] == ["-m", "gateway", "--port", "7001", "--target", "localhost:7002",
                                "--drain-timeout-s", "10"]


def test_up_no_draft_and_model_overrides(tmp_path: Path) -> None:
    specs = _specs("--draft-kind", "none", "--target-model", str(tmp_path))
    assert list(specs) == ["target", "gateway"]
    assert "--draft" not in specs["target"]
    assert specs["target"][-2:] == ["--model", str(tmp_path)]
    assert specs["gateway"][-2:] == ["--model", str(tmp_path)]


def test_up_gives_a_users_draft_the_target(tmp_path: Path) -> None:
    """A head without embed_tokens reads the target's, and the draft learns the target's
    layer count and tokenizer, from its --target-model (the built-in target's when only the
    draft is the user's); a built-in draft keeps its own."""
    target, head = tmp_path / "target", tmp_path / "head"
    specs = _specs("--target-model", str(target), "--draft-model", str(head))
    assert specs["draft"][-4:] == ["--model", str(head), "--target-model", str(target)]
    specs = _specs("--draft-model", str(head))  # the user's draft for the built-in target
    assert specs["draft"][-4:] == ["--model", str(head), "--target-model", str(BUILTIN_TARGET)]
    for kind in ("eagle3", "standalone"):
        assert "--target-model" not in _specs("--target-model", str(target), "--draft-kind",
                                              kind)["draft"]


def test_up_refuses_checkpoint_folders_that_cannot_work_before_it_starts_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Named by up's own flags, with the way out, rather than by a service's init step
    (in that service's flag names) after the others load their models."""
    import shutil

    ours, theirs, head = tmp_path / "ours", tmp_path / "theirs", tmp_path / "head"
    for folder in (ours, theirs, head):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    shutil.copy(BUILTIN_TARGET / "tokenizer.json", ours / "tokenizer.json")
    (theirs / "tokenizer.json").write_text('{"model": {}}')
    parse = build_parser().parse_args
    for fits in (["--target-model", str(ours)], ["--draft-model", str(head)],
                 ["--target-model", str(theirs), "--draft-kind", "none"],
                 ["--target-model", str(theirs), "--draft-model", str(head)],
                 ["--draft-kind", "none", "--draft-model", str(tmp_path / "unused")]):
        assert up_input_error(parse(["up", *fits])) == "", fits
    refused = {
        f"--target-model {tmp_path / 'no'} is not a folder": ["--target-model", str(tmp_path / "no")],
        f"--target-model {head} is not a checkpoint folder: it has no tokenizer.json":
            ["--target-model", str(head)],
        f"--draft-model {tmp_path} is not a checkpoint folder: it has no config.json":
            ["--draft-model", str(tmp_path)],
    }
    for kind in ("eagle3", "standalone"):
        refused[f"--target-model {theirs} has a tokenizer of its own, and the built-in {kind} "
                f"draft fits only the built-in target: pass --draft-model <a draft for {theirs}> "
                f"(`splitspec train-draft` trains an EAGLE-3 head for it), or --draft-kind none"] = \
            ["--target-model", str(theirs), "--draft-kind", kind]
    for message, flags in refused.items():
        assert cmd_up(parse(["up", *flags])) == 2
        assert capsys.readouterr().err == f"splitspec up: {message}\n"


def test_up_uses_this_python() -> None:
    args = build_parser().parse_args(["up"])
    assert all(spec.argv[0] == sys.executable for spec in stack_specs(args))


@pytest.mark.parametrize("command", [[], ["up"], ["generate"], ["status"]])
def test_help_everywhere(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([*command, "--help"])
    assert info.value.code == 0
    assert "usage: splitspec" in capsys.readouterr().out


def test_generate_flags() -> None:
    args = build_parser().parse_args(["generate", "hi", "--stop", "a", "--stop", "b",
                                      "--speculation", "off", "--max-new-tokens", "5"])
    assert (args.text, args.stop, args.speculation, args.max_new_tokens) == ("hi", ["a", "b"], "off", 5)


def test_deadline_flags(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    assert parse(["generate", "hi"]).timeout_s is None
    assert parse(["generate", "hi", "--timeout-s", "2.5"]).timeout_s == 2.5
    assert parse(["generate", "hi", "--timeout-s", "0"]).timeout_s is None
    assert parse(["up"]).generate_timeout_s == 600.0
    assert parse(["up", "--generate-timeout-s", "0"]).generate_timeout_s is None
    for bad in ("-1", "inf", "nan"):
        with pytest.raises(SystemExit) as info:
            parse(["generate", "hi", "--timeout-s", bad])
        assert info.value.code == 2
        assert (f"argument --timeout-s: must be a number of seconds >= 0 (got {bad})"
                in capsys.readouterr().err)
    with pytest.raises(SystemExit):
        parse(["up", "--generate-timeout-s", "soon"])
    assert "argument --generate-timeout-s: not a number of seconds: 'soon'" in capsys.readouterr().err


def test_generate_without_a_gateway_says_where_it_looked(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    assert main(["generate", "hi", "--address", address]) == 1  # (no deadline: fails at once)
    err = capsys.readouterr().err
    assert err.startswith("splitspec: UNAVAILABLE")  # (no text printed: no line break first)
    assert f"is a gateway serving at {address}?" in err
    assert main(["status", "--address", address]) == 1
    assert f"is a gateway serving at {address}?" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "hi"], ["up"]])
def test_max_new_tokens_below_one_is_a_usage_error(command: list[str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """(-5 reached the request's uint32 field and ended in a traceback)"""
    parse = build_parser().parse_args
    assert parse([*command, "--max-new-tokens", "7"]).max_new_tokens == 7
    for bad, message in (("-5", "must be at least 1 (got -5)"), ("0", "must be at least 1"),
                         ("1.5", "not a whole number: '1.5'"),
                         (str(2**32), f"must be at most {2**32 - 1}")):
        with pytest.raises(SystemExit) as info:
            parse([*command, "--max-new-tokens", bad])
        assert info.value.code == 2
        assert f"argument --max-new-tokens: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "hi"], ["up"]])
def test_sampling_flags_reach_the_request(command: list[str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args([*command, "--temperature", "0.7", "--top-k", "20",
                                      "--top-p", "0.9", "--seed", str(2**64 - 1)])
    sampling = CompletionRequest.from_args(args, "x").to_pb().sampling
    assert sampling.temperature == pytest.approx(0.7) and sampling.top_k == 20
    assert sampling.top_p == pytest.approx(0.9) and sampling.seed == 2**64 - 1
    greedy = CompletionRequest.from_args(build_parser().parse_args(command), "x").to_pb()
    assert greedy.sampling.temperature == 0 and not greedy.sampling.HasField("seed")
    for flag, bad, message in (("--seed", "-1", "must be at least 0"),
                               ("--seed", str(2**64), "must be at most"),
                               ("--top-k", "-1", "must be at least 0")):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, flag, bad])
        assert f"argument {flag}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "hi"], ["up"]])
def test_no_special_tokens_reaches_the_request(command: list[str]) -> None:
    """Unset by default (the gateway then adds the tokenizer's special tokens); false with
    --no-special-tokens."""
    default = CompletionRequest.from_args(build_parser().parse_args(command), "x").to_pb()
    assert not default.HasField("add_special_tokens")
    bare = CompletionRequest.from_args(
        build_parser().parse_args([*command, "--no-special-tokens"]), "x").to_pb()
    assert bare.HasField("add_special_tokens") and not bare.add_special_tokens


def test_format_final() -> None:
    final = gateway_pb2.GenerateResponse(
        finish_reason=common_pb2.FINISH_REASON_STOP,
        usage=gateway_pb2.Usage(prompt_tokens=3, completion_tokens=11),
        timings=gateway_pb2.Timings(queue_s=0.01, time_to_first_token_s=0.1, total_s=1.1),
        spec=common_pb2.SpecStats(verify_steps=4, drafted_tokens=16, accepted_tokens=6,
                                  mean_accepted_length=1.5))
    text = format_final(final)
    assert "finish: STOP" in text and "completion 11 tokens" in text
    assert "10.0 tokens/s" in text and "mean accepted length 1.50" in text and "4 verify steps" in text


def test_format_report_table() -> None:
    report = InitReport(service="gateway", steps=[
        StepRecord("load_config", StepState.OK, 0.01, "fine"),
        StepRecord("warmup", StepState.FAILED, 1.5, error_type="RuntimeError", error_message="boom")])
    lines = format_report(report.to_pb(), "gateway")
    assert "FAILED" in lines[0]
    assert "load_config" in lines[2] and "OK" in lines[2] and "fine" in lines[2]
    assert "RuntimeError: boom" in lines[3]
    assert format_report(common_pb2.InitReport(), "draft") == ["draft: no report"]


def test_up_places_draft_and_target_on_the_device_in_its_dtype() -> None:
    """--device cuda: both models in bfloat16 unless --dtype says otherwise; the gateway holds
    no model and gets neither flag; --draft-quantize goes to the draft alone."""
    specs = _specs("--device", "cuda")
    for name in ("draft", "target"):
        assert specs[name][-4:] == ["--device", "cuda", "--dtype", "bfloat16"], specs[name]
    assert "--device" not in specs["gateway"] and "--dtype" not in specs["gateway"]
    specs = _specs("--device", "cuda:1", "--dtype", "float16", "--draft-quantize", "fp8")
    assert specs["draft"][-6:] == ["--device", "cuda:1", "--dtype", "float16", "--quantize", "fp8"]
    assert specs["target"][-4:] == ["--device", "cuda:1", "--dtype", "float16"]
    assert "--quantize" not in specs["target"]
    specs = _specs("--dtype", "bfloat16")  # on the CPU: only the dtype
    assert specs["target"][-2:] == ["--dtype", "bfloat16"] and "--device" not in specs["target"]


def test_up_gives_each_service_its_own_flags_last() -> None:
    specs = _specs("--target-flag=--defer-catch-up=16", "--target-flag=--early-exchange",
                   "--gateway-flag=--spec-policy=static", "--draft-flag=--cpu-threads=2",
                   "--device", "cuda")
    assert specs["target"][-6:] == ["--device", "cuda", "--dtype", "bfloat16",
                                    "--defer-catch-up=16", "--early-exchange"]
    assert specs["gateway"][-1] == "--spec-policy=static"
    assert specs["draft"][-1] == "--cpu-threads=2"
    assert "--cpu-threads=2" not in specs["target"] + specs["gateway"]


def test_up_refuses_draft_flags_without_a_draft(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["up", "--draft-kind", "none", "--draft-flag=--cpu-threads=2"])
    assert info.value.code == 2
    assert "--draft-flag needs a draft" in capsys.readouterr().err


def test_up_refuses_a_quantized_draft_without_a_draft(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["up", "--draft-kind", "none", "--draft-quantize", "fp8"])
    assert info.value.code == 2
    assert "--draft-quantize needs a draft" in capsys.readouterr().err


def test_the_gateway_and_the_client_commands_load_no_torch() -> None:
    """The gateway, `splitspec generate` / `status` and the compose healthcheck (run every
    5 s) never build a tensor: importing them must not load torch (a second and about 180
    MiB of memory on this machine; the gateway's policy reads splitspec.tree, which imports
    torch only for its masks)."""
    import subprocess

    code = ("import sys, gateway.app, splitspec.cli, splitspec.healthcheck; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).resolve().parent.parent)
    assert done.stdout.strip() == "[]", done.stdout
