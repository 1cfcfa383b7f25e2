"""CUDA graphs of the target's steps and the draft's search, emulated on CPU
(tests/graph_emulation.py: a replay runs the captured forward again; Triton interpreted),
against eager steps: what the graphs plan on the host before each replay, checked in CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("case", ["target_steps(3, None)", "target_steps(2, TREE)",
                                  "draft_search()"], ids=["decode", "verify", "draft"])
def test_emulated_graphs_match_eager_steps(case):
    code = ("from tests.graph_emulation import emulate_graphs, target_steps, draft_search; "
            "TREE = [0, 0, 0, 1, 1, 2, 4, 6]; "
            f"emulate_graphs(); {case}; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
