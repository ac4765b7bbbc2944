"""Bounds on what one request may ask of the server, checked before any work starts, and the
body reader that enforces the size and media type (docs/serving.md, "Limits")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged_llm.serve.errors import PayloadTooLarge, UnsupportedMediaType


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds (each a server flag); the defaults leave every realistic request
    alone and stop requests that would only cost memory or time."""

    max_body_bytes: int = 16 * 2**20  # --max-request-body-bytes: larger bodies get a 413
    max_json_depth: int = 64  # --max-json-depth: lists / objects nested deeper get a 400
    max_stop_strings: int = 64  # --max-stop-strings: entries of stop, and of bad_words
    max_stop_string_chars: int = 1024  # --max-stop-string-chars: the longest one
    max_logit_bias: int = 1024  # --max-logit-bias: logit_bias entries

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def is_json_media_type(content_type: str | None) -> bool:
    """True for ``application/json``, with or without parameters (``; charset=utf-8``)."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    return media_type == "application/json"


async def read_body(request: Any, limits: RequestLimits) -> bytes:
    """The body of a JSON request, read while counting: a 415 for another media type, a 413
    as soon as it passes ``limits.max_body_bytes`` (before reading it when Content-Length
    says so), so an oversized body never sits in memory whole."""
    if not is_json_media_type(request.headers.get("content-type")):
        raise UnsupportedMediaType(
            "Unsupported Media Type: only 'application/json' is allowed "
            f"(got {request.headers.get('content-type')!r})"
        )
    limit = limits.max_body_bytes
    too_large = PayloadTooLarge(
        f"the request body is larger than this server's limit of {limit} bytes "
        "(--max-request-body-bytes)"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)
