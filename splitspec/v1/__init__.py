"""Generated protobuf and gRPC code for package splitspec.v1 (see splitspec/protogen.py)."""
