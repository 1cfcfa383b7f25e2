"""Rewrite a flashinfer wheel in place without the CUDA sources of its non-attention
kernels (the sub-folders of flashinfer/data/csrc: MoE, GEMM, FP4/FP8, Blackwell-only).
SplitSpec JIT-compiles only the paged decode and prefill modules, whose sources are
the files directly in csrc/ and the headers under data/include, data/cutlass, data/cccl.

    python bench/device/trim_flashinfer.py .whl/flashinfer_python-0.7.2.post1-py3-none-any.whl
"""

import sys
import zipfile
from pathlib import Path

CSRC = "flashinfer/data/csrc/"


def dropped(name: str) -> bool:
    return name.startswith(CSRC) and "/" in name[len(CSRC):]


def main(path: str) -> None:
    wheel = Path(path)
    trimmed = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        kept = [info for info in src.infolist() if not dropped(info.filename)]
        for info in kept:
            dst.writestr(info, src.read(info))
    trimmed.replace(wheel)
    print(f"{wheel.name}: kept {len(kept)} entries, {wheel.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main(sys.argv[1])
