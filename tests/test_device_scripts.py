"""The device scripts' shell helpers, run with bash: the A/B helper (bench/device/ab_trees.sh:
which code trees an A/B call compares, and the order each round runs them in), setup.sh's
link of the carried flashinfer kernels (bench/device/aot_links.sh) and its unpacking, done
once a call, and the 8B cost-head command the bench scripts share (setup.sh's COSTHEAD_8B)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import bench_concurrency  # noqa: E402  (bench/ is a script folder, not a package)

SHOW = """set -u
source bench/device/ab_trees.sh
echo "trees ${trees[*]}"
for i in 1 2 3 4; do round_order "$i"; echo "round $i ${order[*]}"; done
echo "base ${src[base]}"
"""


def _run(root: Path) -> subprocess.CompletedProcess:
    (root / "bench" / "device").mkdir(parents=True)
    shutil.copy(REPO / "bench" / "device" / "ab_trees.sh", root / "bench" / "device")
    return subprocess.run(["bash", "-c", SHOW], cwd=root, capture_output=True, text=True,
                          timeout=30)


def test_ab_trees_lists_prepared_commits_then_head_and_reverses_even_rounds(tmp_path):
    for name, rev in (("base", "45c9c0b"), ("older", "5d66a54")):
        (tmp_path / ".out" / "ab" / name).mkdir(parents=True)
        (tmp_path / ".out" / "ab" / name / "REV").write_text(rev)
    (tmp_path / ".out" / "ab" / "unprepared").mkdir()  # no REV: not a tree
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "trees base older head",
        "round 1 base older head", "round 2 head older base",
        "round 3 base older head", "round 4 head older base",
        f"base {tmp_path}/.out/ab/base"]


def test_ab_trees_stops_the_call_when_nothing_is_prepared(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 2
    assert "ab_prepare.sh" in done.stdout


LINK = """set -u
source bench/device/aot_links.sh
link_cached_kernels site fiws
"""


def test_cached_flashinfer_kernels_are_linked_into_the_aot_folder_once(tmp_path):
    """setup.sh's link_cached_kernels: each NAME/NAME.so of the carried cache appears where
    flashinfer loads AOT modules without a build; anything else, and a module the AOT
    folder already has, is left alone."""
    (tmp_path / "bench" / "device").mkdir(parents=True)
    shutil.copy(REPO / "bench" / "device" / "aot_links.sh", tmp_path / "bench" / "device")
    ops = tmp_path / "fiws" / ".cache" / "flashinfer" / "0.7.2.post1" / "90a" / "cached_ops"
    for name in ("batch_decode_x", "quantization", "shipped"):
        (ops / name).mkdir(parents=True)
        (ops / name / f"{name}.so").write_text(name)
    (ops / "half_built").mkdir()
    (ops / "half_built" / "half_built.cuda.o").write_text("object")  # no .so: not linked
    (ops / "odd").mkdir()
    (ops / "odd" / "other.so").write_text("odd")  # not NAME.so: not linked
    aot = tmp_path / "site" / "flashinfer" / "data" / "aot"
    (aot / "shipped").mkdir(parents=True)
    (aot / "shipped" / "shipped.so").write_text("from the wheel")

    first = subprocess.run(["bash", "-c", LINK], cwd=tmp_path, capture_output=True, text=True,
                           timeout=30)
    assert first.returncode == 0, first.stderr
    assert "linked from the carried cache: 2" in first.stdout
    assert sorted(p.name for p in aot.iterdir()) == ["batch_decode_x", "quantization", "shipped"]
    for name in ("batch_decode_x", "quantization"):
        link = aot / name / f"{name}.so"
        assert link.is_symlink() and link.read_text() == name
        assert link.resolve() == (ops / name / f"{name}.so").resolve()
    assert (aot / "shipped" / "shipped.so").read_text() == "from the wheel"

    again = subprocess.run(["bash", "-c", LINK], cwd=tmp_path, capture_output=True, text=True,
                           timeout=30)  # a warm machine runs setup.sh again
    assert again.returncode == 0, again.stderr
    assert "linked from the carried cache: 0" in again.stdout


NESTED = """set -u
source bench/device/setup.sh
echo "outer: $(cat .site/marker)"
echo changed > .site/marker
bash -c 'source bench/device/setup.sh; echo "inner: $(cat .site/marker)"; type save_kernel_cache'
"""


def test_setup_unpacks_once_when_a_script_it_runs_sources_it_again(tmp_path):
    """host_cold.sh sources setup.sh, then runs profile_served.sh, which sources it too: the
    second, in a child process, leaves the unpacked packages as they are (no second unpack,
    no second GPU query) and still defines the helpers. nvidia-smi and python3 are stubs
    that count their calls."""
    device = tmp_path / "bench" / "device"
    device.mkdir(parents=True)
    for name in ("setup.sh", "aot_links.sh"):
        shutil.copy(REPO / "bench" / "device" / name, device)
    (tmp_path / "pkg" / "site").mkdir(parents=True)
    (tmp_path / "pkg" / "site" / "marker").write_text("unpacked\n")
    (tmp_path / ".whl").mkdir()
    subprocess.run(["tar", "-cJf", ".whl/site.txz", "-C", "pkg", "site"], cwd=tmp_path,
                   check=True, timeout=30)
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name in ("nvidia-smi", "python3"):
        (stubs / name).write_text(f"#!/bin/sh\necho {name} >> {tmp_path}/calls\n")
        (stubs / name).chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(["bash", "-c", NESTED], cwd=tmp_path, capture_output=True,
                          text=True, timeout=30, env=env)
    assert done.returncode == 0, done.stderr
    assert "outer: unpacked" in done.stdout
    assert "inner: changed" in done.stdout  # not unpacked over again
    assert "save_kernel_cache is a function" in done.stdout
    assert (tmp_path / "calls").read_text().split() == ["nvidia-smi", "python3"]


def test_every_device_script_parses():
    """bash -n on each bench/device/*.sh: a script that only runs on the GPU machine must not
    fail there on its syntax (each call there costs device time)."""
    scripts = sorted((REPO / "bench" / "device").glob("*.sh"))
    assert any(s.name == "ab_concurrency.sh" for s in scripts)
    for script in scripts:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                                timeout=30)
        assert result.returncode == 0, (script.name, result.stderr)


def _stub_device(root: Path) -> dict[str, str]:
    """root as the GPU machine's checkout for setup.sh: the scripts, a carried .whl, and
    stubs of nvidia-smi (a card's name) and python3 (its arguments, a line a call, to
    root/calls); the environment to run a script there with $OUT in root/out."""
    shutil.copytree(REPO / "bench" / "device", root / "bench" / "device")
    (root / "pkg" / "site").mkdir(parents=True)
    (root / ".whl").mkdir()
    subprocess.run(["tar", "-cJf", ".whl/site.txz", "-C", "pkg", "site"], cwd=root,
                   check=True, timeout=30)
    stubs = root / "stubs"
    stubs.mkdir()
    (stubs / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200'\n")
    (stubs / "python3").write_text(f'#!/bin/bash\necho "${{*@Q}}" >> {root}/calls\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    (root / "out").mkdir()
    return {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(root), "OUT": str(root / "out")}


@pytest.mark.parametrize(("script", "args", "expect"), [
    ("costhead.sh", ["fp8 bf16"], [("1,2", "OFF,ON", 3), ("1,2", "OFF,ON", 3)]),
    ("sweep_8b.sh", ["8,16,32", "--step-trace", "s.jsonl"], [("8,16,32", "OFF,ON,adaptive", 6)]),
])
def test_the_8b_cost_head_scripts_run_one_valid_bench_command_each(tmp_path, script, args,
                                                                   expect):
    """costhead.sh and sweep_8b.sh, with the GPU and Python stubbed: each bench command
    they start parses with bench_concurrency.py's own parser and is the shared 8B cost-head
    run (setup.sh's COSTHEAD_8B) at the script's concurrencies, modes and rounds; fp8 adds
    the draft's --quantize, and sweep_8b.sh passes on the flags after its concurrencies."""
    env = _stub_device(tmp_path)
    done = subprocess.run(["bash", f"bench/device/{script}", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = [shlex.split(line) for line in (tmp_path / "calls").read_text().splitlines()]
    benches = [call[2:] for call in calls if call[:2] == ["-u", "bench_concurrency.py"]]
    assert len(benches) == len(expect), calls
    for argv, (concurrency, modes, repeats) in zip(benches, expect, strict=True):
        parsed = bench_concurrency.build_parser().parse_args(argv)
        assert (parsed.random_8b, parsed.draft_kind, parsed.replay_corrupt_rate,
                parsed.replay_cost_head) == (True, "replay", 0.18, True)
        assert argv[argv.index("--concurrency") + 1] == concurrency
        assert (",".join(parsed.modes), parsed.repeats) == (modes, repeats)
        assert parsed.machine == "one NVIDIA H200"
    if script == "costhead.sh":  # fp8 first, as asked: its draft is quantized, bf16's not
        assert {"--draft-flag=--quantize", "--draft-flag=fp8"} <= set(benches[0])
        assert "--draft-flag=--quantize" not in benches[1]
    else:
        assert parsed.step_trace is not None
