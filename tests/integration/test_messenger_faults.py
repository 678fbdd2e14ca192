"""The faulty control plane (trtdisagg/faults/messenger.py) applies a fault plan to typed sends:
drop, duplicate, delay (real ZMQ)."""

from __future__ import annotations

import trio

from trtdisagg.faults.messenger import faulty_dealers, faulty_router
from trtdisagg.faults.spec import FaultInjector, parse_faults
from trtdisagg.transfer.protocol import wire
from trtdisagg.transfer.runtime.messenger import open_dealer, open_router


def _cancel(key: int) -> wire.Cancel:
    return wire.Cancel(key=key, instance_name="gen", instance_rank=0)


def _result(key: int) -> wire.TransferResult:
    return wire.TransferResult(
        key=key, instance_name="ctx", instance_rank=0, status=wire.ResultStatus.OK
    )


async def test_dealer_drops_duplicates_and_delays_by_message_type() -> None:
    faults = FaultInjector(
        plan=parse_faults("drop:CANCEL:1;dup:CANCEL:1;delay:TRANSFER_RESULT:300ms:1")
    )
    open_faulty = faulty_dealers(faults)
    async with open_router() as router, open_faulty(router.endpoint) as dealer:
        started = trio.current_time()
        for message in (_cancel(1), _cancel(2), _result(3), _cancel(4)):
            await dealer.send_message(message)
        got = []
        with trio.fail_after(10):
            for _ in range(4):
                _identity, message, _ = await router.receive_message()
                got.append((message, trio.current_time() - started))
        # CANCEL 1 dropped; CANCEL 2 twice; the delayed result overtaken by CANCEL 4.
        assert [m for m, _ in got] == [_cancel(2), _cancel(2), _cancel(4), _result(3)]
        assert got[-1][1] >= 0.3 and all(t < 0.3 for _, t in got[:3])
        assert [use.fired for use in faults.statistics().rules] == [1, 1, 1]


async def test_router_replies_are_faulted_too() -> None:
    faults = FaultInjector(plan=parse_faults("drop:CANCEL:1"))
    async with (
        open_router() as plain,
        faulty_router(plain, faults) as router,
        open_dealer(plain.endpoint) as dealer,
    ):
        await dealer.send_message(_result(7))
        with trio.fail_after(10):
            identity, _, _ = await router.receive_message()
            router.send_message_nowait(identity, _cancel(8))  # dropped
            router.send_message_nowait(identity, _cancel(9))
            assert await dealer.receive_message() == _cancel(9)
            router.send_message_nowait(identity, _cancel(10))
            assert await dealer.receive_message() == _cancel(10)
