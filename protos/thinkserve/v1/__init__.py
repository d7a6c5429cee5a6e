"""thinkserve.v1 messages and services; regenerate with ``python protos/generate.py``."""
