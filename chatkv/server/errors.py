"""Errors the server answers with, in OpenAI's shape, and the translation of
chatkv's own exceptions into them.

Every error response has the body ``{"error": {"message", "type", "param",
"code"}}`` (as OpenAI's API, and vLLM's and SGLang's servers, answer), so the
official clients raise their usual exceptions (``openai.BadRequestError``,
``AuthenticationError``, ``NotFoundError``, ``ConflictError``,
``RateLimitError``...).
"""

from __future__ import annotations

from typing import Any

#: HTTP status -> OpenAI's error ``type``.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered as ``status`` with OpenAI's error body.

    Attributes:
        status: the HTTP status code.
        message: what went wrong, for a person.
        code: a stable machine-readable code (``context_length_exceeded``,
            ``invalid_api_key``, ``session_busy``...), or None.
        param: the request field at fault, or None.
        headers: extra response headers (``Retry-After``, ``WWW-Authenticate``).
    """

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


def from_exception(exc: BaseException) -> APIError | None:
    """The :class:`APIError` for an exception chatkv raises on purpose, or None
    for anything else (a bug: answered as a 500 by the app)."""
    if isinstance(exc, APIError):
        return exc
    from chatkv import errors as core
    from chatkv.storage import errors as st

    if isinstance(exc, core.ContextWindowExceededError):
        return APIError(400, str(exc), code="context_length_exceeded", param="messages")
    if isinstance(exc, (core.InvalidMessageError, core.EditError)):
        return APIError(400, str(exc), code="invalid_message", param="messages")
    if isinstance(exc, (core.InvalidSessionIdError, st.InvalidSessionIdError)):
        return APIError(400, str(exc), code="invalid_session_id", param="session_id")
    if isinstance(exc, core.ConfigError):
        return APIError(400, str(exc), code="invalid_value")
    if isinstance(exc, st.SessionNotFoundError):
        return APIError(404, str(exc), code="session_not_found")
    if isinstance(exc, core.SessionBusyError):
        return APIError(409, f"{exc}; wait for it to finish (one request per session at a time)",
                        code="session_busy")
    if isinstance(exc, st.SessionLockedError):
        return APIError(409, str(exc), code="session_locked")
    if isinstance(exc, core.QueueFullError):
        return APIError(429, str(exc), code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, core.OutOfBlocksError):
        return APIError(503, f"{exc}; retry later", code="out_of_kv_blocks", headers={"Retry-After": "1"})
    if isinstance(exc, st.StorageError):
        return APIError(500, f"storage failure: {exc}", code="storage_error")
    return None
