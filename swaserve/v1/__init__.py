"""Generated gRPC/protobuf code of protos/swaserve/v1 (scripts/gen_protos.py)."""
