"""A worker told to stop while its model loads: the SIGTERM handler (``brokers.signals``) sets the
stop event on the main thread, so the main thread must never wait on that event's lock (a
handler that runs while ``Event.wait`` holds it blocks on it for good). The run is a process of
its own: it installs the signal handlers a worker does."""

from __future__ import annotations

import subprocess
import sys

# ``threading.Event.wait`` on the main thread, at its unluckiest: a stop signal lands while the
# event's lock is held (the handler then runs at the next bytecode, still under the lock). A
# timer sends the stop too, for code that never calls it.
SCRIPT = r"""
import os, signal, sys, threading, time
from specsplit import workers
from specsplit.config import WorkerSettings
from specsplit.logs import configure_logging

Event = threading.Event

class UnluckyEvent(Event):
    def wait(self, timeout=None):
        if threading.current_thread() is threading.main_thread():
            with self._cond:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
        return super().wait(timeout)

def first_event():  # the first event made next is run_worker's stop event; later ones are plain
    threading.Event = Event
    return UnluckyEvent()

threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
threading.Event = first_event

def loading(service, settings, model_settings):
    time.sleep(600)  # a model that loads for minutes

configure_logging("INFO")
rc = workers.run_worker("target", WorkerSettings(), None, build=loading)
print("rc", rc, flush=True)
os._exit(rc)
"""


def test_a_stop_while_the_model_loads_ends_the_worker():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "rc 0" in run.stdout and "worker_stopped_while_loading" in run.stderr, run.stderr[-2000:]
