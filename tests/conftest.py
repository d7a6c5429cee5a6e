"""Root of the test trees. pytest puts this folder on sys.path, so every tree imports the shared
helpers here (``tiny_llama``) by module name."""
