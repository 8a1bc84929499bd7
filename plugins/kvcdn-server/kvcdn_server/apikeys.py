"""Org API keys: ``kv_`` + hex(HKDF-SHA256(seed, salt empty, info ``kvcdn/api-key/v1/<org>``, 32)).

Keys are derived, never stored: the server knows a set of orgs (``KVCDN_API_KEY_ORGS`` plus the orgs
registered through the admin route, kept in the database so every replica sees them) and each
org's key *generation*. Rotating an org bumps its generation, which changes the HKDF info
of that org only (``.../<org>/r<g>`` for g >= 2), so no other org's key changes.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import re
import threading
import time

import sqlalchemy as sa

from kvcdn_server.db import orgs, readers

SLUG = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
KEY = re.compile(r"^kv_[0-9a-f]{64}$")


def check_slug(slug: str) -> str:
    if not isinstance(slug, str) or not SLUG.match(slug):
        raise ValueError(f"org slug '{slug}' must match {SLUG.pattern}")
    return slug


def hkdf_sha256(ikm: bytes, info: bytes, length: int = 32, salt: bytes = b"") -> bytes:
    """RFC 5869 HKDF with SHA-256 (an empty salt is HashLen zero bytes)."""
    prk = hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def key_info(org: str, generation: int = 1) -> str:
    return f"kvcdn/api-key/v1/{org}" if generation <= 1 else f"kvcdn/api-key/v1/{org}/r{generation}"


def derive_key(seed: bytes, org: str, generation: int = 1) -> str:
    return "kv_" + hkdf_sha256(seed, key_info(org, generation).encode()).hex()


class OrgRegistry:
    """The orgs this server knows, their key generations, and key verification."""

    def __init__(self, seed: bytes, env_orgs: dict[str, int], db_engine, refresh: float = 5.0):
        self.seed = seed
        self.env_orgs = dict(env_orgs)
        self.db = db_engine
        self.refresh = refresh
        self._lock = threading.Lock()
        self._loaded_at = float("-inf")
        self._keys: dict[str, tuple[int, bytes]] = {}

    def _stored(self) -> dict[str, int]:
        with readers(self.db).connect() as c:
            return {slug: int(gen) for slug, gen in c.execute(sa.select(orgs.c.slug, orgs.c.generation))}

    def generations(self, force: bool = False) -> dict[str, int]:
        with self._lock:
            if force or time.monotonic() - self._loaded_at > self.refresh:
                merged = dict(self.env_orgs)
                for slug, gen in self._stored().items():
                    merged[slug] = max(gen, merged.get(slug, 1))
                self._keys = {slug: (gen, derive_key(self.seed, slug, gen).encode()) for slug, gen in merged.items()}
                self._loaded_at = time.monotonic()
            return {slug: gen for slug, (gen, _) in self._keys.items()}

    def verify(self, presented: str) -> str | None:
        """The org whose current key is ``presented``, compared in constant time against every org."""
        if not KEY.match(presented or ""):
            return None
        candidate = presented.encode()
        self.generations()
        match = self._match(candidate)
        if match is None:
            # A key minted or rotated by another replica moments ago: read the database once more
            # rather than refuse it until the next periodic refresh.
            self.generations(force=True)
            match = self._match(candidate)
        return match

    def _match(self, candidate: bytes) -> str | None:
        match = None
        for slug, (_, key) in self._keys.items():  # one snapshot: a reload replaces the dict whole
            if hmac.compare_digest(candidate, key):
                match = slug  # no early exit: the time taken does not depend on which org matched
        return match

    def register(self, slug: str) -> tuple[str, int]:
        """Make ``slug`` known (idempotent); return its current key and generation."""
        check_slug(slug)
        with contextlib.suppress(sa.exc.IntegrityError), self.db.begin() as c:
            if c.execute(sa.select(orgs.c.slug).where(orgs.c.slug == slug)).first() is None:
                c.execute(orgs.insert().values(slug=slug, generation=self.env_orgs.get(slug, 1)))
        gen = self.generations(force=True)[slug]
        return derive_key(self.seed, slug, gen), gen

    def rotate(self, slug: str) -> tuple[str, int] | None:
        """Move ``slug`` to its next key generation (one atomic UPDATE); None when the org is unknown."""
        check_slug(slug)
        if slug not in self.generations(force=True):
            return None
        self.register(slug)  # an org known from the environment gets its row here
        with self.db.begin() as c:
            c.execute(orgs.update().where(orgs.c.slug == slug).values(generation=orgs.c.generation + 1))
            gen = c.execute(sa.select(orgs.c.generation).where(orgs.c.slug == slug)).scalar_one()
        self.generations(force=True)
        return derive_key(self.seed, slug, gen), gen
