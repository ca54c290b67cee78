"""structlog setup for every SpecSplit process. The one implementation lives in ``brokers.logs``
(routers need it and must not import ``specsplit``); this module re-exports it."""

from brokers.logs import configure_logging, get_logger

__all__ = ["configure_logging", "get_logger"]
