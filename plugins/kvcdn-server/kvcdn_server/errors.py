"""API errors: every refusal is ``{"error": <code>, "message": <one line>}`` with its status."""

from __future__ import annotations

import sqlalchemy as sa

from kvcdn_wire import ErrorCode

#: seconds a client is told to wait before retrying after the database could not be reached
DATABASE_RETRY_AFTER_S = 2


class ApiError(Exception):
    """A refusal. Its code is an :class:`~kvcdn_wire.ErrorCode` member, never a string (a test
    reads the server's source for that): the wire package lists every code the server answers."""

    def __init__(self, status: int, code: ErrorCode, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = ErrorCode(code)
        self.message = message
        self.headers = headers or {}


def unauthorized(message: str = "missing or invalid credential") -> ApiError:
    return ApiError(401, ErrorCode.UNAUTHORIZED, message, {"WWW-Authenticate": "Bearer"})


def not_found(what: str = "artifact") -> ApiError:
    return ApiError(404, ErrorCode.NOT_FOUND, f"no such {what}")


def validation(message: str) -> ApiError:
    return ApiError(422, ErrorCode.VALIDATION_ERROR, message)


def database_unavailable(message: str = "the database is unavailable; try again") -> ApiError:
    """503: the request changed nothing (or was handed back) and may be sent again later."""
    return ApiError(503, ErrorCode.DATABASE_UNAVAILABLE, message, {"Retry-After": str(DATABASE_RETRY_AFTER_S)})


def is_database_outage(exc: BaseException) -> bool:
    """True for a database that cannot be reached or is going away (connection refused or cut,
    server shutting down or starting, pool exhausted, lock timeout); false for errors that mean a
    bug in a statement (integrity, syntax, data), which stay 500s."""
    if isinstance(
        exc, (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError, sa.exc.DisconnectionError)
    ):
        return True
    return isinstance(exc, sa.exc.DBAPIError) and bool(exc.connection_invalidated)


def outage_summary(exc: BaseException) -> str:
    """The database's complaint in one line (no statement, no parameters)."""
    orig = getattr(exc, "orig", None) or exc
    text = " ".join(str(orig).split()) or type(orig).__name__
    return f"{type(orig).__name__}: {text[:200]}"
