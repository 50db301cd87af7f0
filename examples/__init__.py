"""Examples, importable from the repository root (``examples.char_gpt:data`` in a config)."""
