"""Defaults shared by the commands, importable without torch."""

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
DEFAULT_QUESTION = "\n\nQ: Summarize the key claim in one sentence.\nA:"
DEFAULT_CHUNK = 512

#: Token selection rules of a composition (kvcdn_core.compose); the first is the default, chosen by
#: the quality table in docs/compose.md.
COMPOSE_RULES = ("deviation", "doc-start")
DEFAULT_COMPOSE_RULE = COMPOSE_RULES[0]
#: The default share of the later documents' tokens recomputed (docs/compose.md, the table).
DEFAULT_RECOMPUTE = 0.3
