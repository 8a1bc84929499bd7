"""kvcdn plugin for vLLM: a v1 KV connector that loads and saves kvcdn ``.kv`` artifacts.

Enable it in vLLM with ``KVTransferConfig(kv_connector="KvcdnConnector",
kv_connector_module_path="kvcdn_vllm", kv_role="kv_both", kv_connector_extra_config={...})``.
Importing this package does not import vLLM or torch (``kvcdn --help`` and ``kvcdn plugins`` stay
fast, and work where vLLM is not installed): the connector class is loaded on first access.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["KvcdnConnector"]


def __getattr__(name: str) -> type:
    if name == "KvcdnConnector":
        from kvcdn_vllm.connector import KvcdnConnector

        return KvcdnConnector
    raise AttributeError(f"module 'kvcdn_vllm' has no attribute {name!r}")
