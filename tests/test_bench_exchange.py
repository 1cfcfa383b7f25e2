"""bench/bench_exchange.py: a short real run through DraftLink, and its refusals."""

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_exchange as bx  # bench/ is a script folder, not a package


def test_a_short_run_reports_the_transit_without_the_drafts_work(tmp_path):
    out = tmp_path / "exchange.json"
    assert bx.main(["--work", "20:0", "--steps", "20", "--repeats", "1",
                    "--out-json", str(out)]) == 0
    [run] = json.loads(out.read_text())["runs"]
    assert (run["draft_ms"], run["target_ms"], run["steps"]) == (20.0, 0.0, 18)
    # the draft's 20 ms of work are not transit; each half is a positive wall-clock span
    assert 0 < run["transit_ms"] < 10
    assert run["to_draft_ms"] > 0 and run["back_ms"] > 0
    assert run["to_draft_ms"] + run["back_ms"] < run["transit_ms"] + 1


@pytest.mark.parametrize("text", ["9", "9:x", "-1:2", "1:2,"])
def test_work_needs_draft_and_target_milliseconds(text):
    with pytest.raises(argparse.ArgumentTypeError):
        bx.parse_work(text)


def test_features_go_on_the_stream_or_through_shared_memory_as_asked(tmp_path, capsys):
    out = tmp_path / "exchange.json"
    assert bx.main(["--work", "0:0", "--steps", "20", "--repeats", "1", "--feature-bytes",
                    "65536", "--via", "stream,memory", "--out-json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(run["via"], run["feature_bytes"], run["steps"]) for run in runs] == [
        ("stream", 65536, 18), ("memory", 65536, 18)]
    assert "features memory: transit" in capsys.readouterr().out


def test_the_exchange_goes_through_a_mailbox_as_asked(tmp_path, capsys):
    """The stand-in draft reads the link's mailbox as the draft service does: the runs
    complete, and each step's transit and halves are measured the same way."""
    out = tmp_path / "exchange.json"
    assert bx.main(["--work", "0:0", "--steps", "20", "--repeats", "1", "--feature-bytes",
                    "4096", "--via", "mailbox", "--out-json", str(out)]) == 0
    [run] = json.loads(out.read_text())["runs"]
    assert (run["via"], run["steps"]) == ("mailbox", 18)
    assert 0 < run["transit_ms"] < 50 and run["to_draft_ms"] > 0 and run["back_ms"] > 0
    assert "features mailbox: transit" in capsys.readouterr().out


def test_via_names_a_way(capsys):
    with pytest.raises(SystemExit):
        bx.main(["--via", "stream,pigeon"])
    assert "--via takes stream, memory and/or mailbox, got 'stream,pigeon'" in \
        capsys.readouterr().err
