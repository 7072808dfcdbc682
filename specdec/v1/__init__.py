"""Generated protobuf/gRPC modules (see scripts/gen_protos.py)."""
