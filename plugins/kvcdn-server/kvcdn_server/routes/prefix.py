"""Prefix index routes: lookup by chain keys, and the roots a caller can search (kvcdn_server.prefix)."""

from __future__ import annotations

from fastapi import APIRouter

import kvcdn_wire as wire
from kvcdn_server import prefix
from kvcdn_server.auth import Auth, Svc
from kvcdn_wire.requests import LookupRequest
from kvcdn_wire.responses import PrefixLookup, PrefixRoots

router = APIRouter()


@router.post(wire.PREFIX_LOOKUP, response_model=PrefixLookup)
def lookup(identity: Auth, body: LookupRequest, s: Svc):
    with s.store.reads.connect() as c:
        return prefix.lookup(c, identity.tenant, body.root, body.keys, body.blocks, body.limit)


@router.get(wire.PREFIX_ROOTS, response_model=PrefixRoots)
def roots(identity: Auth, s: Svc):
    with s.store.reads.connect() as c:
        return {"roots": prefix.roots(c, identity.tenant)}
