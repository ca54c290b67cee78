"""structlog, configured once per process (console for people, JSON on request).

Events are snake_case verbs with fields; session_id and round are bound through contextvars
(``bind_contextvars``) so every line of a round carries them.
"""

from __future__ import annotations

import logging
import sys
import time

import structlog

_configured = False


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write, so a logger configured
    while stderr was temporarily replaced (a test's capture, a redirect) never writes to a
    closed stream later."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "INFO", json: bool = False) -> None:
    """Configure structlog for this process. Idempotent; call once from ``__main__``."""
    global _configured
    lvl = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(lvl, int):
        lvl = logging.INFO
    processors = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str | None = None, **initial):
    """A bound logger; cheap, safe to call at import time (configures nothing)."""
    log = structlog.get_logger(name) if name else structlog.get_logger()
    return log.bind(**initial) if initial else log


class LogLimiter:
    """At most ``per_s`` warnings a second for one event; the rest are counted, not printed."""

    def __init__(self, log, per_s: int = 10) -> None:
        self._log, self._per_s = log, per_s
        self._window, self._count, self._suppressed = 0, 0, 0

    def warning(self, event: str, **kw) -> None:
        sec = int(time.monotonic())
        if sec != self._window:
            if self._suppressed:
                self._log.warning("log_suppressed", count=self._suppressed)
            self._window, self._count, self._suppressed = sec, 0, 0
        self._count += 1
        if self._count <= self._per_s:
            self._log.warning(event, **kw)
        else:
            self._suppressed += 1
