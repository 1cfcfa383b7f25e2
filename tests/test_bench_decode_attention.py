"""bench/bench_decode_attention.py's refusals (the bench itself needs a CUDA device)."""

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_decode_attention as bda  # bench/ is a script folder, not a package


def test_unknown_variants_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        bda.main(["--variants", "tc,fastest"])
    assert "unknown variants ['fastest']" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["0,1", "", "8,-2"])
def test_batch_and_context_lists_need_positive_integers(text):
    with pytest.raises(argparse.ArgumentTypeError, match="positive integers"):
        bda.parse_ints(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without CUDA")
def test_without_cuda_it_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bda.main(["--variants", "tc"])


@pytest.mark.parametrize(("variant", "settings"), [
    ("triton", (32, None)), ("triton16", (16, None)), ("triton64", (64, None)),
    ("triton-s8", (32, 8)), ("triton-s16", (32, 16))])
def test_triton_variants_name_their_block_and_split(variant, settings):
    assert variant in bda.VARIANTS
    assert bda.triton_settings(variant) == settings
