"""A CPU runner's stream: its steps computed one after another in one thread, queued by the loop.

On CUDA a launch queues the step's kernels and returns: the device starts step N+1 the moment
step N is done, while the host finishes step N and schedules step N+2. On the CPU the forward is
the launch itself, so the loop hands each step to this stream instead. Its thread takes the next
step as soon as it is done with one, with no trip through the event loop in between, while the
Trio thread processes the last step's tokens and prepares the next (torch ops let go of the GIL
while they compute).

Steps run in the order they were queued. A step that raises fails alone: the runner hears of it
(`lost`) before the step queued behind it runs. That step's decode rows whose token the failed
step was to sample read a placeholder: their requests fail with the failed step, so what they
compute is dropped. When it has no other row it is not computed at all (`StepSkipped`).
"""

from __future__ import annotations

import queue
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from trtdisagg.worker.engine.ports import StepSkipped
from trtdisagg.worker.launched import LaunchedStep


@attrs.define(eq=False, kw_only=True)
class HostStep:
    """One step on the stream: computed (`launched`), or raised (`error`), once `done` is set."""

    compute: Callable[[], LaunchedStep]
    only_late: bool
    """Every row takes its token from the step queued before (decodes of its requests only)."""
    done: trio.Event = attrs.Factory(trio.Event)
    launched: LaunchedStep | None = None
    error: Exception | None = None

    async def result(self) -> LaunchedStep:
        """The step, once computed; raises what computing it raised."""
        await self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.launched is not None
        return self.launched


@attrs.define(eq=False, kw_only=True)
class HostStream:
    """Runs queued steps in its own thread, in order, while it is `open`."""

    lost: Callable[[], None]
    """Tells the runner that the step it launched last raised."""
    _queue: queue.SimpleQueue[HostStep | None] = attrs.field(
        factory=queue.SimpleQueue, alias="queue"
    )

    @asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        """The stream's thread, for the body of this block (the step loop's lifetime). On the
        way out the thread computes what is queued, then ends; the block waits for it."""
        token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, self._serve, token)
            try:
                yield
            finally:
                self._queue.put(None)

    def submit(self, compute: Callable[[], LaunchedStep], *, only_late: bool) -> HostStep:
        """Queue a step behind the ones queued before it."""
        step = HostStep(compute=compute, only_late=only_late)
        self._queue.put(step)
        return step

    def _serve(self, token: trio.lowlevel.TrioToken) -> None:
        lost = False  # the step before raised
        while (step := self._queue.get()) is not None:
            if lost and step.only_late:
                step.error = StepSkipped("every request in it failed with the step before")
            else:
                try:
                    step.launched, lost = step.compute(), False
                except Exception as exc:
                    step.error, lost = exc, True
                    self.lost()
            token.run_sync_soon(step.done.set)
