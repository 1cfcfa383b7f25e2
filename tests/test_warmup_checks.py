"""The target warmup's check that speculation reproduces plain decoding, exact in float32 and
up to near-ties of the logits in bf16/fp16 (the engine's own loop: test_engine_loop.py)."""

from __future__ import annotations

import pytest
import torch

from target_service.startup import WARMUP_PROMPT, parting


class Logits:
    """An engine stand-in whose last_logits says what OFF's logits were."""

    def __init__(self, row: torch.Tensor) -> None:
        self.row, self.asked = row, []

    def last_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        self.asked.append(prompt_ids)
        return self.row


def row(values: dict[int, float]) -> torch.Tensor:
    logits = torch.full((16,), -5.0)
    for token, value in values.items():
        logits[token] = value
    return logits


def test_equal_outputs_pass_in_any_precision():
    engine = Logits(row({}))
    assert parting(engine, "tree", [1, 2, 3], [1, 2, 3], exact=True) == ""
    assert parting(engine, "tree", [1, 2, 3], [1, 2, 3], exact=False) == ""
    assert engine.asked == []


def test_float32_allows_no_difference():
    with pytest.raises(RuntimeError, match="verification is broken"):
        parting(Logits(row({4: 10.0, 5: 10.0})), "tree", [1, 5], [1, 4], exact=True)


def test_low_precision_allows_a_near_tie_where_they_part():
    engine = Logits(row({4: 10.0, 5: 9.9}))  # OFF chose 4, ON 5: 0.1 apart of 10
    note = parting(engine, "chain", [1, 5, 7], [1, 4, 2], exact=False)
    assert "chain parted from plain at token 1 on a near-tie" in note
    assert engine.asked == [[*WARMUP_PROMPT, 1]]  # OFF's logits after the common prefix


def test_low_precision_refuses_a_real_disagreement():
    engine = Logits(row({4: 10.0, 5: 2.0}))  # ON's token is far below OFF's choice
    with pytest.raises(RuntimeError, match="far from"):
        parting(engine, "tree", [5, 5], [4, 2], exact=False)
