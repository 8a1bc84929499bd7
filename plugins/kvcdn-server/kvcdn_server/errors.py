"""API errors: every refusal is ``{"error": <code>, "message": <one line>}`` with its status."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def unauthorized(message: str = "missing or invalid credential") -> ApiError:
    return ApiError(401, "unauthorized", message, {"WWW-Authenticate": "Bearer"})


def not_found(what: str = "artifact") -> ApiError:
    return ApiError(404, "not_found", f"no such {what}")


def validation(message: str) -> ApiError:
    return ApiError(422, "validation_error", message)
