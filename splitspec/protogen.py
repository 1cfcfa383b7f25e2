"""Generate the protobuf and gRPC Python code in splitspec/v1 from protos/.

The generated files are committed; tests/test_protos.py regenerates them into
a temporary folder and fails when the committed copies are stale.

    python -m splitspec.protogen            # rewrite splitspec/v1/*_pb2*.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "splitspec" / "v1").glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc over protos/; returns the files written under out_root."""
    from grpc_tools import protoc  # test-only dependency (grpcio-tools)

    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p) for p in proto_files()],
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc exited with {code} for {args}")
    return sorted((out_root / "splitspec" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
