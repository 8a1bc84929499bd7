"""Prefix index routes: lookup by chain keys, and the roots a caller can search (kvcdn_server.prefix)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

import kvcdn_wire as wire
from kvcdn_server import prefix
from kvcdn_server.auth import Auth, Identity, Svc
from kvcdn_server.errors import ApiError
from kvcdn_server.routes.artifacts import chunks_grant
from kvcdn_server.services import Services
from kvcdn_wire.requests import LookupRequest
from kvcdn_wire.responses import PrefixLookup, PrefixRoots

router = APIRouter()


@router.post(wire.PREFIX_LOOKUP, response_model=PrefixLookup)
async def lookup(identity: Auth, body: LookupRequest, s: Svc):
    # a coroutine that runs the lookup in the thread pool: FastAPI then checks the answer against
    # its model here, not in one more thread hand-off (the engine's scheduler waits on every lookup)
    return await run_in_threadpool(_lookup, identity, body, s)


def _lookup(identity: Identity, body: LookupRequest, s: Services) -> dict:
    steps = body.step_bytes() if body.grant else None
    heads = (body.heads_at, [bytes.fromhex(h) for h in body.heads]) if body.heads else None
    with s.store.reads.connect() as c:
        answer = prefix.lookup(c, identity.tenant, body.root, body.keys, body.blocks, body.limit, steps, heads)
        best = answer.pop("best")
        # the grant of a match the lookup just showed: an artifact the caller may read, so it reveals
        # nothing the chunks route would not; one that vanished since is no grant (a miss to the
        # client). Its row is read on the lookup's connection: no second checkout.
        answer["grant"] = None
        if best and best in body.held:  # the client holds its grant: name it, nothing to read or sign
            answer["grant"] = {"artifact_id": best, "record": None, "objects": [], "expires_at": "", "held": True}
        elif best:
            try:
                answer["grant"] = chunks_grant(s, identity, best, whole_ok=True, conn=c)
            except ApiError:  # deleted between the index's read and this one
                pass
    return answer


@router.get(wire.PREFIX_ROOTS, response_model=PrefixRoots)
def roots(identity: Auth, s: Svc):
    with s.store.reads.connect() as c:
        return {"roots": prefix.roots(c, identity.tenant)}
