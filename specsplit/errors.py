"""Typed errors shared by the engines, the tree module and the workers (torch-free)."""

from __future__ import annotations

from schemas import ErrorCode


class SpecError(Exception):
    """A typed request error; ``to_reply`` turns it into an ErrorReply on the wire."""

    def __init__(self, code: ErrorCode, message: str, *, retryable: bool | None = None):
        super().__init__(message)
        self.code = code
        self.retryable = retryable

    def to_reply(self, session_id: str | None = None, round: int | None = None):
        from schemas import ErrorReply

        kw = {} if self.retryable is None else {"retryable": self.retryable}
        return ErrorReply.of(self.code, str(self), session_id=session_id, round=round, **kw)


class TreeError(SpecError):
    """An invalid tree (BAD_REQUEST)."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.BAD_REQUEST, message)


class DeviceFailure(Exception):
    """The device itself failed (CUDA error, out of memory, a lost accelerator). Never answered
    to a client: the worker logs it and exits non-zero so the router fails its sessions over."""


class ModelRefused(ValueError):
    """A model the engines cannot run, found when its worker starts (``Engine.check_runs``, a
    layer type the masks do not describe): the worker logs why and exits 2, which its supervisor
    does not restart."""
