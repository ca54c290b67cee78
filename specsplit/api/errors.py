"""The API's error type, answered in OpenAI's error body. No torch; imports nothing of the API
(``specsplit.api.protocol`` re-exports it)."""

from __future__ import annotations


class ApiError(Exception):
    """An error answered in OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
