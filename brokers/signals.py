"""Stop signals that set a ``threading.Event``, safely.

CPython runs a Python signal handler in the main thread between any two bytecodes, and that
includes the bytecodes of a handler already running: a second SIGTERM (honcho signals the whole
process group and the supervisor forwards its own, so a role gets two within microseconds) can
run its handler inside the first one's ``Event.set``, which holds the event's lock, and the
nested ``Event.set`` then waits for that lock for good. Only the first signal sets the event
here; a nested or later one returns at once (the event stays set). The main thread must still
only read the event (``is_set``), never ``wait`` on it: ``sleep_unless`` waits that way; and
where it sets the event itself, it does so with the signals held back (``set_event``).
"""

from __future__ import annotations

import signal
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def once(action):
    """A signal handler that runs ``action()`` for the first signal only, never nested."""
    guard = threading.Lock()  # taken once, never released; acquire(False) takes no wait

    def handler(signum, frame) -> None:
        if guard.acquire(blocking=False):
            action()

    return handler


def set_on_stop_signals(event: threading.Event, signals=STOP_SIGNALS) -> dict:
    """SIGTERM/SIGINT set ``event`` (main thread only); returns the previous handlers, for
    ``restore``. Elsewhere than the main thread nothing is installed and ``{}`` is returned."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    handler = once(event.set)
    return {sig: signal.signal(sig, handler) for sig in signals}


def set_event(event: threading.Event, signals=STOP_SIGNALS) -> None:
    """``event.set()`` from any thread. On the main thread, whose handlers set ``event`` too, a
    handler that ran while this held the event's lock would wait for that lock for good: the
    ``signals`` are blocked meanwhile and run right after."""
    if threading.current_thread() is not threading.main_thread():
        event.set()
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        event.set()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def restore(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def sleep_unless(event: threading.Event, seconds: float, step_s: float = 0.05) -> bool:
    """``event.wait(seconds)`` for a main thread whose signal handler sets ``event``: it sleeps
    in slices and only reads the flag. ``Event.wait`` holds the event's lock for a moment, and a
    handler that runs then (signal handlers run in the main thread, between any two bytecodes)
    blocks in ``Event.set`` on that same lock for good (Python's docs: no locks in signal
    handlers). True when the event was set."""
    deadline = time.monotonic() + seconds
    while not event.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(step_s, left))
    return True
