"""Layer entries are typed in code and unchanged on disk: each cache layout's header is byte for byte
the one pinned in tests/support/pinned_headers.json (written before layer entries were typed, and
pinned again for format version 2, whose only change is the tensors' digest key, blake3 for sha256)."""

from __future__ import annotations

import json

import pytest

from tests.support import pinned_headers

PINNED = json.loads(pinned_headers.PINNED.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return pinned_headers.headers(tmp_path_factory.mktemp("headers"))


def test_every_layout_is_pinned():
    assert set(PINNED) == set(pinned_headers.ARCHITECTURES)


@pytest.mark.parametrize("architecture", pinned_headers.ARCHITECTURES)
def test_header_bytes_are_unchanged(written, architecture):
    assert written[architecture] == PINNED[architecture]
