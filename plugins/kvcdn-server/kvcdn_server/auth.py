"""Who is calling: FastAPI dependencies for org API keys, OIDC access tokens and the admin secret."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from kvcdn_server.errors import ApiError, unauthorized
from kvcdn_server.services import Services, services
from kvcdn_wire import ErrorCode


@dataclass
class Identity:
    customer_id: str
    method: str  # api_key | oidc
    org: str | None = None
    subject: str | None = None
    issuer: str | None = None
    email: str | None = None

    @property
    def tenant(self) -> str:
        return self.customer_id

    def as_dict(self) -> dict[str, Any]:
        return {
            "customer_id": self.customer_id,
            "org": self.org,
            "project": "default",
            "method": self.method,
            "subject": self.subject,
            "issuer": self.issuer,
            "email": self.email,
        }


def authenticate(request: Request, s: Services, required: bool = True) -> Identity | None:
    header = request.headers.get("authorization")
    if not header:
        if required:
            raise unauthorized("this route needs Authorization: Bearer <token or kv_ API key>")
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise unauthorized("use Authorization: Bearer <token or kv_ API key>")
    if token.startswith("kv_"):
        org = s.orgs.verify(token)
        if org is None:
            raise unauthorized("invalid API key")
        identity = Identity(f"org:{org}", "api_key", org=org)
    else:
        if s.verifier is None:
            raise unauthorized("this server has no OIDC issuer configured; use an org API key")
        claims = s.verifier.verify(token)
        identity = Identity(
            claims.customer_id, "oidc", subject=claims.subject, issuer=claims.issuer, email=claims.email
        )
    legacy_org = request.path_params.get("org") or request.headers.get("x-kvcdn-org") or request.query_params.get("org")
    if legacy_org and identity.method == "api_key" and legacy_org != identity.org:
        raise ApiError(403, ErrorCode.FORBIDDEN, "the org given does not match the API key's org")
    return identity


def identity_required(request: Request, s: Annotated[Services, Depends(services)]) -> Identity:
    identity = authenticate(request, s)
    assert identity is not None  # required=True raises instead of answering None
    return identity


def identity_optional(request: Request, s: Annotated[Services, Depends(services)]) -> Identity | None:
    return authenticate(request, s, required=False)


def require_admin(request: Request, s: Annotated[Services, Depends(services)]) -> None:
    """The admin secret, as ``X-Kvcdn-Admin-Secret`` or (the original client) ``Authorization: Bearer``."""
    given = request.headers.get("x-kvcdn-admin-secret")
    if given is None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else ""
    if not hmac.compare_digest(given.encode(), s.config.admin_secret.encode()):
        raise ApiError(403, ErrorCode.FORBIDDEN, "missing or wrong admin secret (X-Kvcdn-Admin-Secret or Bearer)")


Auth = Annotated[Identity, Depends(identity_required)]
MaybeAuth = Annotated[Identity | None, Depends(identity_optional)]
Svc = Annotated[Services, Depends(services)]
