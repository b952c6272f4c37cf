"""Errors of the server as OpenAI's API returns them: a status and
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
          503: "ServiceUnavailableError"}


class ApiError(Exception):
    """A request the server answers with ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}


__all__ = ["ApiError"]
