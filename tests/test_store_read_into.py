"""``pack.read_into``: an object read into memory the caller chose (the vLLM tier's ready buffers)
comes back as exactly its bytes, whatever the medium's pieces; into the caller's memory only when
the object is the size the caller expected, otherwise as it came, for the digest check to refuse."""

from __future__ import annotations

import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcdn_core.errors import ArtifactError
from kvcdn_core.store.pack import checked, digest_of, read_into


class ReadOnly:
    """A stream without ``readinto`` (some storage clients' bodies): read in pieces."""

    def __init__(self, data: bytes):
        self._stream = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        return self._stream.read(min(n, 7) if n > 0 else n)  # short reads, as a network stream gives


def pieces_of(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=300),
    expected=st.integers(0, 300),
    cuts=st.lists(st.integers(0, 300), max_size=6),
    medium=st.sampled_from(["readinto", "read", "pieces"]),
)
def test_the_bytes_come_back_whole_and_in_the_callers_memory_only_at_their_expected_size(data, expected, cuts, medium):
    into = memoryview(bytearray(b"\xaa" * expected))
    source = {"readinto": io.BytesIO(data), "read": ReadOnly(data), "pieces": pieces_of(data, cuts)}[medium]
    got = read_into(source, into)
    assert bytes(got) == data
    assert (got is into) == (len(data) == expected)


@settings(max_examples=100, deadline=None)
@given(
    size=st.integers(0, 3000),
    cuts=st.lists(st.integers(0, 3000), max_size=6),
    medium=st.sampled_from(["readinto", "read", "pieces"]),
)
def test_landed_tells_how_many_bytes_are_in_place_as_they_arrive(size, cuts, medium):
    from unittest import mock

    from kvcdn_core.store import pack

    data = bytes(i % 251 for i in range(size))
    into = memoryview(bytearray(size))
    source = {"readinto": io.BytesIO(data), "read": ReadOnly(data), "pieces": pieces_of(data, cuts)}[medium]
    snapshots: list[tuple[int, bytes]] = []
    with mock.patch.object(pack, "LANDED_STEP", 256):  # small steps: several per object
        got = read_into(source, into, lambda n: snapshots.append((n, bytes(into[:n]))))
    assert got is into and bytes(got) == data
    assert [n for n, _ in snapshots] == sorted(n for n, _ in snapshots)
    assert all(front == data[:n] for n, front in snapshots)  # each told front is the object's
    assert not size or snapshots[-1][0] == size
    if medium == "readinto":
        assert all(b - a <= 256 for a, b in zip([0, *(n for n, _ in snapshots)], (n for n, _ in snapshots)))


def test_a_short_or_long_object_is_refused_by_the_digest_check_in_one_line():
    data = bytes(range(200))
    for body in (data[:150], data + b"more"):
        got = read_into(io.BytesIO(body), memoryview(bytearray(len(data))))
        with pytest.raises(ArtifactError, match="is corrupted") as refused:
            checked(got, digest_of(data), len(data), "the store")
        assert "\n" not in str(refused.value)
