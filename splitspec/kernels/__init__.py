"""Triton kernels, each with its torch reference (the tests compare them)."""

import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None
