"""Which requests launched steps still compute, and the blocks that wait for those steps (pure).

With asynchronous steps a request can end (its stop token arrives, its client leaves) while a
step that computes it is still queued on the device: that step writes its next token's KV into
the request's last block. Its blocks must not go back to the pool before the step ran, or a
later step, a KV transfer into fresh blocks or a prefix-cache hit could meet a block that a
running kernel still writes. The scheduler counts here the launched, unfinished plans that hold
each request, and parks the blocks of those that end until their last such plan finished.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import attrs

from trtdisagg.kv.block_pool import BlockTable


@attrs.define(eq=False)
class InFlight:
    _plans: collections.Counter[int] = attrs.Factory(collections.Counter)  # by request id
    _parked: dict[int, BlockTable] = attrs.Factory(dict)

    def launched(self, request_ids: Iterable[int]) -> None:
        """A plan holding these requests was launched."""
        self._plans.update(request_ids)

    def finished(self, request_ids: Iterable[int]) -> list[BlockTable]:
        """A plan holding these requests ran: the parked tables no plan holds any more."""
        free = []
        for request_id in request_ids:
            self._plans[request_id] -= 1
            if self._plans[request_id] > 0:
                continue
            del self._plans[request_id]
            table = self._parked.pop(request_id, None)
            if table is not None:
                free.append(table)
        return free

    def computing(self, request_id: int) -> bool:
        """Whether a launched plan that has not finished holds the request."""
        return request_id in self._plans

    def park(self, request_id: int, table: BlockTable) -> None:
        """Hold an ended request's blocks until the plans computing it finished."""
        self._parked[request_id] = table

    @property
    def num_parked(self) -> int:
        return len(self._parked)
