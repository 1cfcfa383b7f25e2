"""Triton kernels, each with its torch reference (the tests compare them)."""
