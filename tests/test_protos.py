"""The committed generated code in splitspec/v1 matches protos/ (regenerated here)."""

from pathlib import Path

from splitspec.protogen import REPO_ROOT, generate


def test_generated_code_is_fresh(tmp_path: Path):
    fresh = generate(tmp_path)
    assert fresh, "protoc produced nothing"
    committed_dir = REPO_ROOT / "splitspec" / "v1"
    stale = [p.name for p in fresh if p.read_text() != (committed_dir / p.name).read_text()]
    assert not stale, f"regenerate with `python -m splitspec.protogen`: stale {stale}"
    names = {p.name for p in fresh}
    extra = {p.name for p in committed_dir.glob("*_pb2*.py*")} - names
    assert not extra, f"generated files without a .proto: {extra}"
