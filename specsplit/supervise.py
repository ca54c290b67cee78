"""Crash-only roles: ``specsplit router|draft|target|pair|orchestrator`` run as a small supervising
parent and one child that does the role's work.

honcho stops the whole fleet when any process exits, so supervision lives inside each role's
command. The supervisor (this module and ``brokers.signals``: stdlib only, no torch, no zmq;
its settings come from the caller) starts the child with the same command line
(``python -m specsplit <role> ...``, so operators find it with ``ps``) and
``SPECSPLIT_SUPERVISED_CHILD=1`` in its environment, and:

- restarts it with exponential back-off (``supervise_backoff_s`` doubling up to
  ``supervise_backoff_max_s``; reset after ``supervise_stable_s`` of uptime) when it dies
  abnormally (killed by a signal, OOM, any exit code other than 0 and 2), logging and counting
  each restart (``role_restarted`` with ``restarts``);
- exits with the child's code when it exits 0 (done) or 2 (bad settings / refused: restarting
  cannot help), or after ``supervise_max_quick_restarts`` deaths in a row that each came before
  ``supervise_stable_s`` of uptime (a crash loop: a missing model, a port held by another program);
- on SIGTERM/SIGINT forwards SIGTERM to the child, waits up to ``supervise_stop_timeout_s`` for
  it to drain and exit (then SIGKILL), and exits 0 when the child stopped cleanly.

The child asks the kernel for SIGTERM when the supervisor dies (PR_SET_PDEATHSIG), so a
``kill -9`` of the supervisor never leaves an orphan serving. A worker restarted here rejoins
under the same identity: the child inherits HONCHO_PROCESS_NAME (see WorkerSettings.identity).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

from brokers.signals import sleep_unless

CHILD_MARKER = "SPECSPLIT_SUPERVISED_CHILD"
RESTARTS_VAR = "SPECSPLIT_SUPERVISED_RESTARTS"  # brokers.settings.MetricsSettings.supervised_restarts
NO_RESTART_CODES = (0, 2)  # done, or bad settings / refused: restarting cannot help
_PR_SET_PDEATHSIG = 1


def is_supervised_child(environ=None) -> bool:
    return (os.environ if environ is None else environ).get(CHILD_MARKER) == "1"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the child outlives a killed supervisor (honcho's killpg still reaches it)


def backoff_delay(restarts_in_a_row: int, base_s: float, max_s: float) -> float:
    """Delay before the n-th consecutive restart (n >= 1): base, 2 base, 4 base, ... capped."""
    return min(max_s, base_s * (2 ** max(0, restarts_in_a_row - 1)))


class Supervisor:
    """Runs ``argv`` (the role's ``specsplit`` arguments) as a child until stopped."""

    def __init__(self, argv: list[str], settings, *, out=sys.stderr) -> None:
        self.argv, self.s, self.out = list(argv), settings, out
        self.role = " ".join(argv[:2]) if argv[:1] == ["router"] else (argv[0] if argv else "?")
        self.stop = threading.Event()
        self._first_signal = threading.Lock()  # taken once, never released
        self.child: subprocess.Popen | None = None
        self.restarts = 0

    def _log(self, event: str, **fields) -> None:
        # one line per event, readable beside structlog's console output (no logging setup here)
        if self.s.log_json:
            line = json.dumps({"event": event, "logger": "specsplit.supervise", "role": self.role, **fields})
        else:
            line = f"[supervise] {event} role={self.role} " + " ".join(f"{k}={v}" for k, v in fields.items())
        print(line, file=self.out, flush=True)

    def _on_signal(self, signum, frame) -> None:
        # a second signal can run this inside the first one's Event.set (brokers.signals): only
        # the first sets the event, a nested one would wait for the lock that one holds
        if self._first_signal.acquire(blocking=False):
            self.stop.set()
        child = self.child
        if child is not None and child.poll() is None:
            try:
                child.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _spawn(self) -> subprocess.Popen:
        # the restart count travels to the child, which exports it (specsplit:process_restarts_total)
        env = {**os.environ, CHILD_MARKER: "1", RESTARTS_VAR: str(self.restarts)}
        return subprocess.Popen([sys.executable, "-m", "specsplit", *self.argv], env=env,
                                preexec_fn=_die_with_parent)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        in_a_row = 0
        while True:
            started = time.monotonic()
            self.child = self._spawn()
            self._log("role_started", pid=self.child.pid, restarts=self.restarts)
            if self.stop.is_set():  # a signal arrived between two children
                self._on_signal(signal.SIGTERM, None)
            rc = self._wait_child()
            uptime = time.monotonic() - started
            if self.stop.is_set():
                self._log("role_stopped", rc=rc, restarts=self.restarts)
                return 0 if rc in (0, -signal.SIGTERM) else (rc if rc > 0 else 1)
            if rc in NO_RESTART_CODES:
                self._log("role_exited", rc=rc, restarts=self.restarts)
                return rc
            in_a_row = 1 if uptime >= self.s.supervise_stable_s else in_a_row + 1
            if in_a_row > self.s.supervise_max_quick_restarts:
                self._log("role_crash_loop", rc=rc, deaths_in_a_row=in_a_row, restarts=self.restarts)
                return rc if rc > 0 else 1
            delay = backoff_delay(in_a_row, self.s.supervise_backoff_s, self.s.supervise_backoff_max_s)
            self.restarts += 1
            self._log("role_died", rc=rc, uptime_s=round(uptime, 2), restarts=self.restarts, backoff_s=delay)
            if sleep_unless(self.stop, delay):
                self._log("role_stopped", rc=rc, restarts=self.restarts)
                return 0

    def _wait_child(self) -> int:
        """The child's exit code (negative: killed by that signal); bounded once stopping."""
        child = self.child
        while True:
            try:
                return child.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            if self.stop.is_set():
                try:
                    return child.wait(timeout=self.s.supervise_stop_timeout_s)
                except subprocess.TimeoutExpired:
                    self._log("role_kill", pid=child.pid, waited_s=self.s.supervise_stop_timeout_s)
                    child.kill()
                    return child.wait(timeout=10)


def supervise(argv: list[str], settings) -> int | None:
    """Run ``argv`` under a supervisor (``settings``: a ``specsplit.config.SupervisorSettings``),
    or return None when this process should do the work itself (it is the supervised child, or
    SPECSPLIT_SUPERVISE=false)."""
    if is_supervised_child() or not settings.supervise:
        return None
    try:
        return Supervisor(argv, settings).run()
    finally:  # exiting: a late SIGTERM must not turn exit 0 into -15 (see cli._ignore_stop_signals)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
