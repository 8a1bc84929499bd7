"""An org API key minted on one replica works on another at once, not after its periodic refresh."""

from __future__ import annotations

from kvcdn_server.apikeys import OrgRegistry, derive_key
from kvcdn_server.db import open_database

SEED = b"s" * 32


def test_a_key_minted_on_one_replica_is_accepted_by_another_at_once(tmp_path):
    engine = open_database(f"sqlite:///{tmp_path / 'kvcdn.db'}")
    a = OrgRegistry(SEED, {}, engine, refresh=3600)
    b = OrgRegistry(SEED, {}, engine, refresh=3600)
    assert b.verify(derive_key(SEED, "acme")) is None  # b has now loaded (and cached) no orgs
    key, _ = a.register("acme")
    assert b.verify(key) == "acme"
    rotated, generation = a.rotate("acme")
    assert generation == 2 and b.verify(rotated) == "acme"
    assert b.verify(derive_key(SEED, "nobody")) is None
