"""The JSON body of an error in each API's shape: OpenAI's (``ApiError.body``) and Anthropic's (:func:`anthropic_error`).

Chat Completions, Completions and Responses answer ``{"error": {"message", "type", "param", "code"}}``;
the Messages API (``/v1/messages``) answers ``{"type": "error", "error": {"type", "message"}}``.
Apart from lollm.serve.messages so that the guard (lollm.serve.guard), which refuses requests
before any route runs, answers each API in its own shape without importing the APIs.
"""

from __future__ import annotations

from lollm.serve.requests import ApiError

#: HTTP status -> Anthropic's error type (any other status: "api_error").
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                         429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(error: ApiError) -> dict[str, object]:
    """``error`` in Anthropic's shape: ``{"type": "error", "error": {"type": ..., "message": ...}}``."""
    kind = ANTHROPIC_ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_for_path(error: ApiError, path: str) -> dict[str, object]:
    """``error``'s body in the shape of the API that ``path`` belongs to (Anthropic's under ``/v1/messages``)."""
    return anthropic_error(error) if path.startswith("/v1/messages") else error.body()
