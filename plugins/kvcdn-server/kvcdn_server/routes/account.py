"""Health, who am I, API-key verification and the caller's quota."""

from __future__ import annotations

from fastapi import APIRouter, Request

import kvcdn_core
import kvcdn_wire as wire
from kvcdn_server.auth import Auth, Svc
from kvcdn_server.errors import unauthorized
from kvcdn_wire.requests import VerifyRequest
from kvcdn_wire.responses import Health, Identity, KeyVerification, Quota

router = APIRouter()


@router.get(wire.HEALTH, response_model=Health)
def health(s: Svc):
    return {
        "status": "ok",
        "version": kvcdn_core.__version__,
        "storage": s.storage_kind,
        "database": s.db_engine.dialect.name,
    }


@router.get(wire.WHOAMI, response_model=Identity)
def whoami(identity: Auth):
    return identity.as_dict()


@router.post(wire.VERIFY_API_KEY, response_model=KeyVerification)
def verify_key(request: Request, s: Svc, body: VerifyRequest | None = None):
    key = body.api_key if body else None
    if key is None:
        header = request.headers.get("authorization", "")
        key = header.partition(" ")[2].strip() if header.lower().startswith("bearer ") else ""
    org = s.orgs.verify(key or "")
    if org is None:
        raise unauthorized("invalid API key")
    return {"customer_id": f"org:{org}", "org": org, "method": "api_key"}


@router.get(wire.QUOTA, response_model=Quota)
def quota(identity: Auth, s: Svc):
    limits, used = s.store.limits(), s.store.usage(identity.tenant)
    return {
        "customer_id": identity.customer_id,
        "limits": limits,
        "usage": used,
        # the original client's table
        "quota": {
            "organizations": 1,
            "projects": 1,
            "artifacts": limits["artifacts"],
            "storage_bytes": limits["storage_bytes"],
        },
        "used": {
            "organizations": 1,
            "projects": 1,
            "artifacts": used["artifacts"],
            "storage_bytes": used["storage_bytes"],
        },
    }
