"""Telemetry intake: anyone may post (no auth), rate-limited per client address."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

import kvcdn_wire as wire
from kvcdn_server.auth import Svc
from kvcdn_server.errors import ApiError
from kvcdn_wire import ErrorCode
from kvcdn_wire.telemetry import TelemetryEvent

router = APIRouter()


@router.post(wire.TELEMETRY, status_code=204)
def telemetry(body: TelemetryEvent, request: Request, s: Svc):
    client = request.client.host if request.client else "unknown"
    if not s.telemetry.submit(body.model_dump(exclude_none=True), client):
        raise ApiError(429, ErrorCode.RATE_LIMITED, "too many telemetry events; slow down", {"Retry-After": "1"})
    return Response(status_code=204)
