"""Quantization: :mod:`.codec` quantizes a cache's tensors and dequantizes them on load,
:mod:`.service` is what ``kvcdn quant`` runs, :mod:`.phase` is the quantized phase of ``kvcdn validate``.

Schemes are plugins (:mod:`kvcdn_core.contracts.quantizer`, built-ins in :mod:`kvcdn_core.builtin.quantizers`).
"""
