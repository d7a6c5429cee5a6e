"""Generated gRPC contract, package thinkserve.v1 (see protos/generate.py)."""
