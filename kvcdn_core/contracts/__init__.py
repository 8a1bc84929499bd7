"""The contracts a plugin implements: base classes and constants, no plugin lookup.

- :mod:`kvcdn_core.contracts.adapter`: :class:`ModelAdapter`, one architecture family.
- :mod:`kvcdn_core.contracts.quantizer`: :class:`Quantizer`, one quantization scheme.
- :mod:`kvcdn_core.contracts.storage`: :class:`StorageBackend`, where artifacts live.

Plugins import these names from :mod:`kvcdn_core` (the public plugin API), not from here.
"""
