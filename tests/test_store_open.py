"""``kvcdn store`` reaches a store through one interface: a backend that declares ``chunk_store``
gives its own, any other backend gets core's :class:`ChunkStore` on its bytes; a method of that
name that is not declared is never called (capabilities are declared, never probed)."""

from __future__ import annotations

from kvcdn_core.builtin.local_storage import LocalStorage
from kvcdn_core.store.chunkstore import ChunkStore, open_chunk_store


class OwnStore:
    """Stands for a medium's own chunk store (the hosted endpoint's)."""


class Declares(LocalStorage):
    capabilities = frozenset({"chunk_store"})

    def chunk_store(self):
        return OwnStore()


class Undeclared(LocalStorage):
    def chunk_store(self):  # its own business, not the capability
        raise AssertionError("an undeclared capability was called")


def test_a_declared_chunk_store_is_the_backends_own(tmp_path):
    assert isinstance(open_chunk_store(Declares(tmp_path)), OwnStore)


def test_any_other_backend_gets_core_chunk_store_on_its_bytes(tmp_path):
    backend = Undeclared(tmp_path)
    store = open_chunk_store(backend)
    assert isinstance(store, ChunkStore) and store.backend is backend
    assert isinstance(open_chunk_store(LocalStorage(tmp_path)), ChunkStore)


def test_kvcdn_store_refuses_check_and_gc_of_a_store_that_owns_them(tmp_path, monkeypatch):
    """The commands call the interface: a store whose check raises is refused in one line."""
    from click.testing import CliRunner

    from kvcdn_core import KvcdnError
    from kvcdn_core.cli.app import make_cli

    class Owned(OwnStore):
        def check(self, now=None):
            raise KvcdnError("the medium checks its own chunks")

        def gc(self, now=None):
            raise KvcdnError("the medium collects its own chunks")

    monkeypatch.setattr("kvcdn_core.store.chunkstore.open_chunk_store", lambda backend: Owned())
    for command, says in (("check", "checks"), ("gc", "collects")):
        result = CliRunner().invoke(make_cli(), ["store", command, "--store", str(tmp_path)])
        assert result.exit_code == 2, (result.stdout, result.stderr)
        assert result.stderr.strip() == f"error: the medium {says} its own chunks"
