from __future__ import annotations

import logging
import time

import pytest
import trio

from trtdisagg.loop_lag import watch_loop_lag


async def test_a_blocked_loop_is_measured_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    lags: list[float] = []
    first = trio.Event()
    blocked = trio.Event()

    def observe(lag: float) -> None:
        lags.append(lag)
        first.set()
        if lag >= 0.2:
            blocked.set()

    caplog.set_level(logging.WARNING, logger="trtdisagg.loop_lag")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_loop_lag, observe)
        with trio.fail_after(5):
            await first.wait()
        assert not blocked.is_set()
        time.sleep(0.3)  # noqa: ASYNC251 (the blocking call being measured: it holds the loop)
        with trio.fail_after(5):
            await blocked.wait()
        nursery.cancel_scope.cancel()
    assert max(lags) >= 0.2
    assert "event loop blocked" in caplog.text
