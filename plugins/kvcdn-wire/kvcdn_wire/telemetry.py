"""The telemetry event (``POST /api/v1/telemetry``): what the client sends, what the server takes."""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

PropKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
PropValue = Union[bool, int, float, Annotated[str, StringConstraints(max_length=256)]]


class TelemetryEvent(BaseModel):
    """One usage event (``POST /api/v1/telemetry``)."""

    model_config = ConfigDict(extra="forbid")

    event: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_.-]{0,63}$")]
    kvcdn_version: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    command: Annotated[str, StringConstraints(max_length=64)] | None = None
    ok: bool | None = None
    duration_ms: Annotated[float, Field(ge=0)] | None = None
    os: Annotated[str, StringConstraints(max_length=32)] | None = None
    python: Annotated[str, StringConstraints(max_length=16)] | None = None
    install_id: Annotated[str, StringConstraints(max_length=64)] | None = None
    props: Annotated[dict[PropKey, PropValue], Field(max_length=20)] | None = None
