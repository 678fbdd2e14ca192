"""A process's service under Trio until SIGTERM or SIGINT, then its cleanup to the end.

The handlers stay installed until the cancelled service has finished its cleanup. Left to the
default action, a second signal (Ctrl-C twice, a supervisor or script that signals again) would
kill the process halfway through it: an API front's socket directory left in /tmp, ranks and
fronts left for their own parent-death checks to end. A repeat is logged instead; SIGKILL still
ends the process at once.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable

import trio


async def serve_until_signal(serve: Callable[[], Awaitable[None]], log: logging.Logger) -> None:
    """Run `serve` until it returns, or until SIGTERM/SIGINT cancels it; either way return once
    its cleanup is over."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            service = trio.CancelScope()

            async def run() -> None:
                with service:
                    await serve()
                nursery.cancel_scope.cancel()  # over (cancelled, or it ended itself: a drain)

            nursery.start_soon(run)
            async for signum in signals:
                name = signal.Signals(signum).name
                if service.cancel_called:
                    log.info("received %s again: still stopping", name)
                else:
                    log.info("received %s, stopping", name)
                    service.cancel()
