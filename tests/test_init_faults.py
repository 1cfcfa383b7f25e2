"""Every init step of every service, made to fail: the service exits non-zero within seconds,
its report names the step and the error, and health never said SERVING."""

from __future__ import annotations

import json
import socket

import pytest
import torch
from grpc_health.v1 import health_pb2

from tests.stack import Service, free_port

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
TARGET_STEPS = ["load_config", "bind_port", "init_distributed", "load_model", "allocate_kv_cache",
                "init_attention_backend", "connect_draft", "capture_cuda_graphs", "warmup",
                "start_server"]
DRAFT_STEPS = ["load_config", "bind_port", "load_model", "allocate_kv_cache", "init_attention_backend",
               "capture_cuda_graphs", "warmup", "start_server"]
GATEWAY_STEPS = ["load_config", "load_tokenizer", "start_server", "connect_target", "open_stream",
                 "warmup"]


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    service = Service("draft_service", [], tmp_path_factory.mktemp("draft")).wait_serving()
    yield service
    service.stop()


@pytest.fixture(scope="module")
def target(draft, tmp_path_factory):
    service = Service("target_service", ["--draft", draft.address],
                      tmp_path_factory.mktemp("target")).wait_serving()
    yield service
    service.stop()


def assert_failed_at(service: Service, step: str, report_path) -> None:
    code, seen = service.wait_exit(timeout_s=60)
    assert code != 0, service.log
    assert SERVING not in seen, f"health said SERVING before {step} failed"
    report = json.loads(report_path.read_text())
    failed = [s for s in report["steps"] if s["state"] == "FAILED"]
    assert [s["name"] for s in failed] == [step], report
    assert failed[0]["error_type"] == "InjectedFault"
    assert step in failed[0]["error_message"] and failed[0]["traceback"]
    assert not report["ok"]
    # Later steps never ran; earlier ones finished.
    names = [s["name"] for s in report["steps"]]
    after = names[names.index(step) + 1:]
    assert all(s["state"] == "PENDING" for s in report["steps"] if s["name"] in after)
    assert f'"name": "{step}"' in service.log  # the JSON report was printed too


@pytest.mark.parametrize("step", DRAFT_STEPS)
def test_draft_fault(step, tmp_path):
    report = tmp_path / "report.json"
    service = Service("draft_service", ["--init-report", str(report)], tmp_path,
                      env={"SPLITSPEC_INJECT_INIT_FAULT": step})
    assert_failed_at(service, step, report)


@pytest.mark.parametrize("step", TARGET_STEPS)
def test_target_fault(step, draft, tmp_path):
    report = tmp_path / "report.json"
    service = Service("target_service", ["--draft", draft.address, "--init-report", str(report)],
                      tmp_path, env={"SPLITSPEC_INJECT_INIT_FAULT": step})
    assert_failed_at(service, step, report)


@pytest.mark.parametrize("step", GATEWAY_STEPS)
def test_gateway_fault(step, target, tmp_path):
    report = tmp_path / "report.json"
    service = Service("gateway", ["--target", target.address, "--init-report", str(report)],
                      tmp_path, env={"SPLITSPEC_INJECT_INIT_FAULT": step})
    assert_failed_at(service, step, report)


def test_draft_vocab_mismatch_fails_target_naming_both_sizes(tmp_path):
    from splitspec.builtin.build import write_llama

    write_llama(tmp_path / "small", {"vocab_size": 1000, "hidden_size": 32, "intermediate_size": 64,
                                     "num_hidden_layers": 1, "num_attention_heads": 2,
                                     "num_key_value_heads": 1, "head_dim": 16}, seed=3)
    message = connect_draft_failure(tmp_path, ["--model", str(tmp_path / "small")], [])
    assert "draft vocabulary size 1000" in message
    assert "target vocabulary size 2048" in message


def test_a_draft_with_a_shorter_context_fails_target_naming_both(tmp_path):
    """Past the draft's context every step of a sequence would decode without a tree (and
    log why): refused at start instead."""
    message = connect_draft_failure(tmp_path, ["--max-context", "64"], ["--max-context", "128"])
    assert "the draft holds sequences of up to 64 tokens, the target's reach 128" in message


def connect_draft_failure(tmp_path, draft_args: list[str], target_args: list[str]) -> str:
    """A draft started with ``draft_args`` and a target with ``target_args`` pointed at it:
    the target must stop without serving, its connect_draft step failed; that step's error."""
    draft = Service("draft_service", draft_args, tmp_path).wait_serving()
    try:
        report = tmp_path / "report.json"
        target = Service("target_service", ["--draft", draft.address, *target_args,
                                            "--init-report", str(report)], tmp_path)
        code, seen = target.wait_exit(timeout_s=60)
    finally:
        draft.stop()
    assert code != 0 and SERVING not in seen
    step = next(s for s in json.loads(report.read_text())["steps"] if s["state"] == "FAILED")
    assert step["name"] == "connect_draft"
    return step["error_message"]


def test_draft_and_target_run_one_cpu_thread_by_default(draft, target):
    """Each service sets its torch threads in load_model and says so: with torch's default (a
    thread per core in every process) plain decoding ran up to 3.3x slower on 2 cores."""
    for service in (draft, target):
        detail = next(line for line in service.log.splitlines() if "load_model" in line
                      and "parameters" in line)
        assert "1 CPU thread" in detail, detail


def test_negative_cpu_threads_fails_load_model(draft, tmp_path):
    report = tmp_path / "report.json"
    service = Service("target_service", ["--draft", draft.address, "--cpu-threads", "-1",
                                         "--init-report", str(report)], tmp_path)
    code, seen = service.wait_exit(timeout_s=60)
    assert code != 0 and SERVING not in seen
    failed = [s for s in json.loads(report.read_text())["steps"] if s["state"] == "FAILED"]
    assert [s["name"] for s in failed] == ["load_model"]
    assert "--cpu-threads" in failed[0]["error_message"]


@pytest.mark.parametrize(("sizes", "message"), [("2,x", "not comma-separated node counts"),
                                                ("0,8", "each size must be 1 to 64")])
def test_bad_graph_tree_sizes_fail_load_config(sizes, message, draft, tmp_path):
    """Refused in the first step, saying what is wrong, not when the graphs are captured."""
    report = tmp_path / "report.json"
    service = Service("target_service", ["--draft", draft.address, "--graph-tree-sizes", sizes,
                                         "--init-report", str(report)], tmp_path)
    code, seen = service.wait_exit(timeout_s=60)
    assert code != 0 and SERVING not in seen
    failed = [s for s in json.loads(report.read_text())["steps"] if s["state"] == "FAILED"]
    assert [s["name"] for s in failed] == ["load_config"]
    assert message in failed[0]["error_message"]


def test_a_feature_memory_dir_that_is_not_there_fails_load_config(draft, tmp_path):
    """A volume not mounted where --feature-memory-dir says is refused in the first step,
    not found out when the first stream's features silently take the slow way."""
    report = tmp_path / "report.json"
    service = Service("target_service", ["--draft", draft.address, "--feature-memory-dir",
                                         str(tmp_path / "missing"), "--init-report",
                                         str(report)], tmp_path)
    code, seen = service.wait_exit(timeout_s=60)
    assert code != 0 and SERVING not in seen
    failed = [s for s in json.loads(report.read_text())["steps"] if s["state"] == "FAILED"]
    assert [s["name"] for s in failed] == ["load_config"]
    assert f"--feature-memory-dir {tmp_path / 'missing'} is not a directory" in \
        failed[0]["error_message"]


def test_a_checkpoint_config_without_its_shape_fails_load_config_naming_the_file(tmp_path):
    """The target's and the draft's first step name the checkpoint's config.json and the
    keys it lacks, not a bare KeyError."""
    from draft_service.config import DraftConfig
    from draft_service.startup import load_config as load_draft_config
    from target_service.config import TargetConfig
    from target_service.startup import load_config as load_target_config

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    lacks = f"{config} lacks vocab_size, intermediate_size, num_hidden_layers, num_attention_heads"
    with pytest.raises(ValueError, match=lacks):
        load_target_config(TargetConfig(model=tmp_path))
    with pytest.raises(ValueError, match=lacks):
        load_draft_config(DraftConfig(model=tmp_path))


def test_a_profile_out_in_a_missing_directory_fails_load_config(tmp_path):
    """Found out in the first step, not when the target stops and writes the profile."""
    from target_service.config import TargetConfig
    from target_service.startup import load_config

    with pytest.raises(ValueError, match="missing is not a directory"):
        load_config(TargetConfig(profile_out=tmp_path / "missing" / "engine.prof"))
    assert load_config(TargetConfig(profile_out=tmp_path / "engine.prof")).value is not None


def test_the_targets_eos_ids_include_those_of_generation_config(tmp_path):
    """An Instruct checkpoint may name its end-of-turn token only in generation_config.json
    (Llama-3-8B-Instruct's <|eot_id|>): the target's EOS ids, which the engine stops on and
    TargetInfo reports, include it, and load_config's report names them."""
    import shutil

    from splitspec.builtin import BUILTIN_TARGET
    from target_service.config import TargetConfig
    from target_service.startup import load_config

    for name in ("config.json", "tokenizer.json"):
        shutil.copy(BUILTIN_TARGET / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    got = load_config(TargetConfig(model=tmp_path))
    assert got.value.config.eos_token_ids == (0, 7)
    assert got.detail.endswith("EOS ids 0, 7")


def test_a_max_context_too_short_for_the_warmup_fails_load_config():
    """Found out in the first step, not by the warmup's first generation."""
    from target_service.config import TargetConfig
    from target_service.startup import load_config

    with pytest.raises(ValueError, match="--max-context 15 is below the 16 tokens the start-up's "
                                         "warmup generates"):
        load_config(TargetConfig(max_context=15))
    assert load_config(TargetConfig(max_context=16)).value is not None


def test_a_negative_defer_catch_up_fails_load_config():
    from target_service.config import TargetConfig
    from target_service.startup import load_config

    with pytest.raises(ValueError, match="--defer-catch-up -1: give tokens, or 0"):
        load_config(TargetConfig(defer_catch_up=-1))
    assert load_config(TargetConfig(defer_catch_up=16)).value is not None


def test_graph_tree_sizes_default_to_the_tree_and_the_small_chain():
    from target_service.config import TargetConfig

    assert TargetConfig().verify_graph_sizes == (3, 8)
    assert TargetConfig(num_draft_tokens=2).verify_graph_sizes == (2, 3)
    assert TargetConfig(graph_tree_sizes="8, 2,8").verify_graph_sizes == (2, 8)


@pytest.mark.parametrize("module", ["target_service", "draft_service"])
def test_a_taken_port_fails_bind_port_before_the_model_loads(module, draft, tmp_path):
    """The port is bound second: a port another process holds fails start-up before any
    weights are read (it failed start_server, the last step, after warmup)."""
    report = tmp_path / "report.json"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        args = ["--draft", draft.address] if module == "target_service" else []
        service = Service(module, [*args, "--init-report", str(report)], tmp_path, port=port)
        code, seen = service.wait_exit(timeout_s=60)
    assert code != 0 and SERVING not in seen
    steps = {s["name"]: s for s in json.loads(report.read_text())["steps"]}
    assert steps["bind_port"]["state"] == "FAILED", steps
    assert str(port) in steps["bind_port"]["error_message"]
    assert "another process holds the port" in steps["bind_port"]["error_message"]
    assert steps["load_model"]["state"] == "PENDING"


@pytest.mark.parametrize("service", ["draft", "target"])
def test_a_failed_start_up_gives_its_port_back(monkeypatch, service):
    """In process: load_model fails after bind_port has bound the port; build gives it back
    (gRPC keeps a bound port that never served until the process exits), so a second
    server can bind it at once."""
    import draft_service.__main__
    import draft_service.startup
    import target_service.__main__
    import target_service.startup
    from splitspec.grpc_server import ServiceServer
    from splitspec.init_report import InitFailed, Startup

    main, startup_module = {"draft": (draft_service.__main__, draft_service.startup),
                            "target": (target_service.__main__, target_service.startup)}[service]
    port = free_port()
    cfg = main.parse_args(["--port", str(port)])
    monkeypatch.setenv("SPLITSPEC_INJECT_INIT_FAULT", "load_model")
    startup = Startup(service, startup_module.STEPS)
    with pytest.raises(InitFailed):
        if service == "draft":
            startup_module.build(cfg, startup)
        else:
            startup_module.build(cfg, startup, lambda engine: None)
    assert startup.report.failed_step.name == "load_model"
    ServiceServer(f"127.0.0.1:{port}", 1, []).release()  # raises if the port were still held


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host where torch sees no GPU")
@pytest.mark.parametrize("module", ["target_service", "draft_service"])
def test_a_gpu_torch_cannot_see_fails_load_config(module, draft, tmp_path):
    """--device cuda where torch has no GPU is refused in the first step, saying so, before
    any weights are read (it failed load_model with torch's bare AssertionError)."""
    report = tmp_path / "report.json"
    args = ["--draft", draft.address] if module == "target_service" else []
    service = Service(module, [*args, "--device", "cuda", "--init-report", str(report)], tmp_path)
    code, seen = service.wait_exit(timeout_s=60)
    assert code != 0 and SERVING not in seen
    failed = [s for s in json.loads(report.read_text())["steps"] if s["state"] == "FAILED"]
    assert [s["name"] for s in failed] == ["load_config"]
    assert "--device cuda: torch" in failed[0]["error_message"]
    assert "sees no GPU here; use --device cpu" in failed[0]["error_message"]


def test_check_device_names_what_is_wrong():
    from splitspec.model.loader import check_device

    check_device("cpu")
    check_device("cpu", ranks=4)  # (tensor-parallel ranks on the CPU need no GPUs)
    for device, message in (("bogus", "--device 'bogus' is not a torch device: Expected one of"),
                            ("cuda:x", "--device 'cuda:x' is not a torch device: Invalid")):
        with pytest.raises(ValueError, match=message):
            check_device(device)
    count = torch.cuda.device_count()
    wanted = "sees no GPU here" if count == 0 else f"needs {count + 1} GPU\\(s\\); torch sees {count}"
    with pytest.raises(ValueError, match=wanted):
        check_device(f"cuda:{count}")
    with pytest.raises(ValueError, match=wanted if count == 0 else f"with --tp {count + 1} needs"):
        check_device("cuda", ranks=count + 1)
