"""Admin routes (the admin secret): mint and rotate org API keys."""

from __future__ import annotations

from fastapi import APIRouter, Depends

import kvcdn_wire as wire
from kvcdn_server.apikeys import check_slug
from kvcdn_server.auth import Svc, require_admin
from kvcdn_server.errors import not_found, validation
from kvcdn_wire.requests import OrgRequest
from kvcdn_wire.responses import OrgKey

router = APIRouter(dependencies=[Depends(require_admin)])


def slug_of(body: OrgRequest) -> str:
    try:
        return check_slug(body.org_slug.strip().lower())
    except ValueError as exc:
        raise validation(str(exc)) from None


@router.post(wire.ADMIN_API_KEYS, response_model=OrgKey)
def mint_key(body: OrgRequest, s: Svc):
    slug = slug_of(body)
    key, generation = s.orgs.register(slug)
    return {"api_key": key, "org_slug": slug, "customer_id": f"org:{slug}", "generation": generation}


@router.post(wire.ADMIN_ROTATE, response_model=OrgKey)
def rotate_key(body: OrgRequest, s: Svc):
    slug = slug_of(body)
    rotated = s.orgs.rotate(slug)
    if rotated is None:
        raise not_found("org")
    key, generation = rotated
    return {"api_key": key, "org_slug": slug, "customer_id": f"org:{slug}", "generation": generation}
