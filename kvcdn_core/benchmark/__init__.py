"""Prefill against cached continuation, measured end to end: the library behind `kvcdn benchmark`.

One module per idea: :mod:`.inputs` (lengths, schemes, context ids, threads, checked before
anything is timed), :mod:`.timing` (warm-up and reps, the plain-read and FLOP limits),
:mod:`.measure` (the timed runs), :mod:`.result` (rows), :mod:`.report` (CSV, table, JSON);
cold files are :mod:`kvcdn_core.artifact.pagecache`'s. The names below are what scripts under
``benchmarks/`` use. Nothing here imports torch at import time.
"""

from kvcdn_core.benchmark.inputs import context_ids, installed_schemes, set_threads
from kvcdn_core.benchmark.timing import plain_read

__all__ = ["context_ids", "installed_schemes", "plain_read", "set_threads"]
