"""``StorageBackend.open_read``: a streaming binary reader, from local disk and from the portable
default that backends without streaming inherit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvcdn_core import KvcdnError, LocalStorage, StorageBackend


class CopyOnly(StorageBackend):
    """A backend with nothing but put/get (the default open_read stages through get_file)."""

    def __init__(self, root: Path):
        self.root = root

    def put_file(self, key, source):
        shutil.copyfile(source, self.root / key)

    def get_file(self, key, target):
        if not (self.root / key).is_file():
            raise KvcdnError(f"no object '{key}'")
        shutil.copyfile(self.root / key, target)

    def exists(self, key):
        return (self.root / key).is_file()


@pytest.mark.parametrize("make", [LocalStorage, CopyOnly])
def test_open_read_streams_the_object_and_refuses_a_missing_one(tmp_path, make):
    store = make(tmp_path)
    data = bytes(range(256)) * 5000
    (tmp_path / "obj").write_bytes(data)
    with store.open_read("obj") as body:
        chunks = []
        while block := body.read(65536):
            chunks.append(block)
    assert b"".join(chunks) == data and len(chunks) > 1
    with pytest.raises(KvcdnError, match="no object"):
        store.open_read("missing")
