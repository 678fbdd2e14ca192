"""`serve_until_signal`: a signal cancels the service; one more during its cleanup is logged, not
obeyed (the default action would kill the process halfway through the cleanup)."""

from __future__ import annotations

import logging
import signal

import pytest
import trio
import trio.testing

from trtdisagg.stop_signals import serve_until_signal

LOG = logging.getLogger("tests.stop_signals")


class _Said(logging.Handler):
    """Sets `event` once a record containing `text` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


async def test_a_second_signal_during_the_cleanup_is_logged_and_the_cleanup_finishes() -> None:
    again = _Said("received SIGTERM again: still stopping")
    LOG.addHandler(again)
    LOG.setLevel(logging.INFO)
    cleaned = []

    async def serve() -> None:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True), trio.fail_after(10):
                signal.raise_signal(signal.SIGTERM)  # the handler is still ours
                await again.event.wait()
                cleaned.append(True)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_until_signal, serve, LOG)
            await trio.testing.wait_all_tasks_blocked()
            signal.raise_signal(signal.SIGTERM)
    finally:
        LOG.removeHandler(again)
    assert cleaned == [True]


async def test_a_service_that_ends_by_itself_or_fails_ends_the_wait() -> None:
    async def drained() -> None:
        await trio.lowlevel.checkpoint()

    with trio.fail_after(10):
        await serve_until_signal(drained, LOG)

    async def failing() -> None:
        raise RuntimeError("rank 1 died")

    with pytest.raises(BaseExceptionGroup) as raised:
        await serve_until_signal(failing, LOG)
    assert raised.group_contains(RuntimeError, match="rank 1 died")
