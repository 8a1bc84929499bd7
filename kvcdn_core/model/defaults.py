"""Defaults shared by the commands, importable without torch."""

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
DEFAULT_QUESTION = "\n\nQ: Summarize the key claim in one sentence.\nA:"
DEFAULT_CHUNK = 512
