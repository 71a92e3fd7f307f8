"""Generated gRPC/protobuf code for m27.v1 — do not edit; run `task proto`."""
