"""The plugin host: :mod:`.hookspecs` (the hooks plugins implement), :mod:`.manager` (loading plugins
and calling their hooks) and :mod:`.registry` (lookup by family, scheme and URL: the only caller of the host).
"""
