"""kvcdn core: the plugin contract, the `.kv` artifact format and the transformers runtime.

Importing this package must stay cheap: it never imports torch or transformers.
"""

import pluggy

__version__ = "0.1.0"

#: The marker plugins use to implement kvcdn hooks: ``@kvcdn_core.hookimpl``.
hookimpl = pluggy.HookimplMarker("kvcdn")

__all__ = ["__version__", "hookimpl"]
