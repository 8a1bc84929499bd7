"""Core's click commands, one per module; :mod:`kvcdn_core.builtin.commands` registers them.

A command parses its options, calls the library and renders the result through
:mod:`kvcdn_core.cli.render`; the work itself lives in the library.
"""
