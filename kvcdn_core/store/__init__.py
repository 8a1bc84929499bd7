"""The chunk store: artifacts cut into token chunks, stored once by content, found by a prefix index.

An artifact's per-token tensors are cut into chunks of :data:`~kvcdn_core.store.keys.CHUNK_TOKENS`
tokens. Each chunk has two names: its *chain key* (what tokens it holds, after which prefix, for
which model and representation: :mod:`kvcdn_core.store.keys`) and its *content digest* (the
BLAKE3 of its bytes, the name it is stored under). The prefix index maps chain keys to the
artifacts holding them, so a lookup hashes the query and probes, whatever the store's size.
"""
