"""Background responses (the Responses API's ``background: true``): a generation that goes on in
the API process whatever its client does, polled with ``GET /v1/responses/{id}``, its events
streamed again from any point (``?stream=true&starting_after=N``), cancelled with ``POST
/v1/responses/{id}/cancel`` (``specsplit.api.responses``). No torch.

Running responses count against the API's concurrent requests (``streaming.launch``: a 429
beyond them); of the finished ones, the events of the last ``KEPT`` are kept for streaming again
(the responses themselves go to the store, as any stored response).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from specsplit.api.generation import Done, Failed, Generation
from specsplit.api.protocol import ApiError

if TYPE_CHECKING:
    from specsplit.api.response_events import Builder

KEPT = 64  # finished runs whose events are kept
FOLLOW_WAKE_S = 15.0  # a follower's wait for news, checked again after it (the run has its own timeouts)


class Run:
    """One background response: its builder and every event it made, in order."""

    def __init__(self, builder: Builder) -> None:
        self.builder = builder
        self.events: list[dict] = []
        self.done = False
        self.task: asyncio.Task | None = None
        self._news = asyncio.Event()

    def push(self, events: list[dict]) -> None:
        self.events += events
        news, self._news = self._news, asyncio.Event()
        news.set()

    async def follow(self, after: int) -> AsyncIterator[dict]:
        """The events numbered after ``after``, then the new ones as they come, until the run ends."""
        i = max(after + 1, 0)
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            news = self._news
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(news.wait(), FOLLOW_WAKE_S)


class BackgroundRuns:
    """The running background responses, and the last ``kept`` finished ones, by id."""

    def __init__(self, kept: int = KEPT) -> None:
        self.kept = kept
        self._runs: OrderedDict[str, Run] = OrderedDict()

    def __len__(self) -> int:
        return len(self._runs)

    def get(self, rid: str) -> Run | None:
        return self._runs.get(rid)

    def start(self, builder: Builder, gen: Generation, release: Callable[[], None],
              keep: Callable[[], None]) -> Run:
        """The run of a launched generation: its events fed to ``builder`` on a task of its own;
        ``keep()`` stores the response once it has ended (completed, incomplete, failed or
        cancelled); ``release()`` frees the generation's places however it ends."""
        run = Run(builder)
        run.push(builder.start())
        run.task = asyncio.ensure_future(self._drive(run, gen, release, keep))
        self._runs[builder.id] = run
        return run

    async def _drive(self, run: Run, gen: Generation, release, keep) -> None:
        b = run.builder
        try:
            while (ev := await gen.next()) is not None:
                if b.status == "queued":
                    run.push(b.begin())
                if isinstance(ev, Failed):
                    run.push(b.fail(ev.error))
                    break
                run.push(b.feed(ev))
                if isinstance(ev, Done):
                    break
        except asyncio.CancelledError:
            b.cancel()  # (POST .../cancel, DELETE, or the server's shutdown)
        except Exception as exc:  # noqa: BLE001  (a defect: this response fails, the API goes on)
            run.push(b.fail(ApiError(500, f"internal error: {type(exc).__name__}", type="server_error",
                                     code="internal_error")))
        finally:
            release()
            keep()
            run.done = True
            run.push([])
            self._forget_finished()

    def _forget_finished(self) -> None:
        finished = [rid for rid, r in self._runs.items() if r.done]
        for rid in finished[:max(0, len(finished) - self.kept)]:
            del self._runs[rid]

    async def cancel(self, rid: str) -> Run | None:
        """Cancels a run (a finished one is left as it is); None when there is none of that id."""
        run = self._runs.get(rid)
        if run is not None and run.task is not None and not run.done:
            run.task.cancel()
            await asyncio.gather(run.task, return_exceptions=True)
        return run

    async def forget(self, rid: str) -> Run | None:
        run = await self.cancel(rid)
        self._runs.pop(rid, None)
        return run

    async def close(self) -> None:
        """Cancels every running response (the server is stopping)."""
        for rid in list(self._runs):
            await self.cancel(rid)
