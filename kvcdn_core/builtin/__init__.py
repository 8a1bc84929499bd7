"""Core's own plugins: local storage, the int8/int8-tensor/fp8 quantizers and the core commands.

The plugin host registers these modules by name, through the same hooks as any installed plugin,
so core dogfoods its own contract and no other core module imports them.
"""
