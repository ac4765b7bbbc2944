"""OpenAI-style API errors: an exception per HTTP status and the JSON body clients expect."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    status_code = 500
    error_type = "internal_server_error"
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def body(self) -> dict[str, Any]:
        """The JSON body of the response."""
        return error_body(self.message, self.error_type, self.param, self.code)


class BadRequest(APIError):
    """400: the request is malformed or asks for something impossible."""

    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(APIError):
    """401: missing or wrong API key."""

    status_code = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class NotFound(APIError):
    """404: the request names something this server does not have."""

    status_code = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFound(NotFound):
    """404: the request names a model this server does not serve."""

    default_code = "model_not_found"


class Conflict(APIError):
    """409: the request cannot be done in the server's current state (retry later)."""

    status_code = 409
    error_type = "invalid_request_error"
    default_code = "conflict"


class PayloadTooLarge(BadRequest):
    """413: the request body is over the server's limit (``--max-request-body-bytes``)."""

    status_code, default_code = 413, "payload_too_large"


class UnsupportedMediaType(BadRequest):
    """415: the body is not ``application/json``."""

    status_code, default_code = 415, "unsupported_media_type"


class ServerBusy(APIError):
    """429: the waiting queue is full; the client should retry later."""

    status_code = 429
    error_type = "rate_limit_error"
    default_code = "server_busy"


class EngineUnavailable(APIError):
    """503: the engine is shutting down or has stopped after an internal error."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "engine_unavailable"


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` as the OpenAI API returns it."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
