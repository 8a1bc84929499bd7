"""The ``kvcdn`` command line: :mod:`.app` (the entry point), :mod:`.commands` (one module per
command), :mod:`.render` (tables and JSON) and :mod:`.reference` (generates docs/cli.md).
"""
