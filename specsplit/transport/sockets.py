"""The one socket factory lives in ``brokers.sockets`` (the lowest layer that opens sockets, so
routers need nothing from ``specsplit``); this module re-exports it for the rest of SpecSplit."""

from brokers.sockets import (
    DEFAULT_HWM, MAX_IDENTITY_BYTES, endpoint, is_loopback_address, make_monitored_socket, make_socket, recv_frames,
    send_frames,
)

__all__ = ["DEFAULT_HWM", "MAX_IDENTITY_BYTES", "endpoint", "is_loopback_address", "make_monitored_socket",
           "make_socket", "recv_frames", "send_frames"]
