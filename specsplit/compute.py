"""One thread for every model computation of a worker process.

Torch's and llama.cpp's CPU kernels parallelise with OpenMP, and both use the same libgomp (the
one torch ships: llama.cpp's ``libgomp.so.1`` resolves to it once torch is loaded). libgomp keeps
a team of threads per thread that starts parallel regions, and once it manages more threads than
the machine has cores it stops spinning at barriers altogether (its "throttled" spin count, 0
under ``OMP_WAIT_POLICY=PASSIVE``): every barrier of a forward then sleeps on a futex and wakes
the other thread, and a forward has hundreds of barriers. A worker that loaded its model on one
thread and ran forwards on another (or on two: the socket thread's fast path and the engine
thread) crossed that line on a 2-core box: the 1.5B llama.cpp target's 1-token verify took much
longer, with far more context switches (docs/results.md, commit afaf148). So a worker loads its
model and runs every forward on one ``ComputeThread``.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class Task:
    """A callable submitted to a ComputeThread: ``join``/``is_alive`` as a thread's, ``result``."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._value = self.fn()
        except BaseException as exc:  # handed to the caller of result()
            self._error = exc
        finally:
            self._done.set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def result(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError("the compute thread did not finish the task in time")
        if self._error is not None:
            raise self._error
        return self._value


class ComputeThread:
    """A daemon thread that runs submitted callables one at a time, in order (daemon: a stuck
    forward never keeps the process from exiting)."""

    def __init__(self, name: str = "specsplit-engine"):
        self._jobs: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        while (task := self._jobs.get()) is not None:
            task._run()

    def submit(self, fn: Callable[[], Any]) -> Task:
        task = Task(fn)
        if threading.current_thread() is self._thread:
            task._run()  # already on it: queueing would wait for itself
        else:
            self._jobs.put(task)
        return task

    def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)`` on the compute thread; its result, or its exception raised here."""
        return self.submit(lambda: fn(*args, **kwargs)).result()

    def close(self) -> None:
        """End the thread after the tasks already submitted."""
        self._jobs.put(None)
