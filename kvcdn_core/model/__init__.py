"""What kvcdn knows about a model apart from running it: :mod:`.files` (finding the files, the
fingerprint), :mod:`.defaults`, the layer kinds beyond plain attention (:mod:`.linear_attention`,
:mod:`.mla`), the RoPE guard every adapter's forward runs under (:mod:`.rope_regime`) and the tiny
validation configs (:mod:`.tiny`). Loading and running a model is :mod:`kvcdn_core.runtime`.
"""
