"""Exactness checks: does continuing from a saved cache give what a full prefill gives?

:mod:`.against_prefill` checks one artifact (``kvcdn verify`` and ``kvcdn diag``);
:mod:`.architecture` runs the phases that check one architecture end to end (``kvcdn validate`` and
the contract test suite). The structure of a file alone is checked by :mod:`kvcdn_core.artifact`.
"""
