"""ctx's writes made ready before their KV is (generation-first). Pure bookkeeping.

With generation_first, gen's REQUEST_DATA usually reaches ctx while the prefill that produces
the KV still runs. The executor tells the transceiver which blocks the KV will be in when it
schedules the prompt's last chunk (`expect`); the transceiver then maps the write and has the
agent prepare it (descriptor lists, the transfer request) during the forward. When the KV is
ready, only the post is left: on an H200 host that takes the write's start from ~0.3 ms after
the KV is ready down to the post call itself.

A prepared write is used only for the very request and source it was made for (`take`); anything
else is released. Nothing here posts: a prepared write is only ever posted where the write would
have been made anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from trtdisagg.transfer.agents.base import XferHandle
from trtdisagg.transfer.fragments import Fragments
from trtdisagg.transfer.sessions import SourceBlocks
from trtdisagg.transfer.wire import NoticeTemplate, RequestData


@attrs.frozen(kw_only=True)
class PreparedWrite:
    request: RequestData
    source: SourceBlocks
    fragments: Fragments
    remote: str
    handle: XferHandle
    notice: NoticeTemplate  # its notification, once the first tokens are known
    told_at: float | None = None  # when gen was told (WRITE_PREPARED); None: not told


@attrs.frozen(kw_only=True)
class _Expected:
    source: SourceBlocks
    deadline: float


@attrs.define
class PreparedWrites:
    """Expected sources by transfer key, and the writes prepared from them by (key, gen rank)."""

    _expected: dict[int, _Expected] = attrs.field(factory=dict)
    _writes: dict[tuple[int, int], PreparedWrite] = attrs.field(factory=dict)

    def __len__(self) -> int:
        """Writes prepared and not yet taken or dropped."""
        return len(self._writes)

    def expect(
        self, key: int, block_ids: Sequence[Sequence[int]], num_tokens: int, deadline: float
    ) -> list[XferHandle]:
        """The KV of `key` will be in `block_ids`. Returns the handles of writes prepared from
        a different earlier expectation of `key` (to release)."""
        source = SourceBlocks(block_ids=tuple(map(tuple, block_ids)), num_tokens=num_tokens)
        old = self._expected.get(key)
        stale = [] if old is None or old.source == source else self.drop(key)
        self._expected[key] = _Expected(source=source, deadline=deadline)
        return stale

    def source(self, key: int) -> SourceBlocks | None:
        expected = self._expected.get(key)
        return None if expected is None else expected.source

    def add(self, key: int, write: PreparedWrite) -> XferHandle | None:
        """Keep `write` for gen rank `write.request.instance_rank`; returns a handle it replaces
        (to release), if any."""
        old = self._writes.get((key, write.request.instance_rank))
        self._writes[(key, write.request.instance_rank)] = write
        return None if old is None else old.handle

    def ready(self, key: int, source: SourceBlocks) -> list[PreparedWrite]:
        """The writes prepared for `key` from exactly `source` (left in place)."""
        return [w for (k, _), w in self._writes.items() if k == key and w.source == source]

    def take(
        self, key: int, request: RequestData, source: SourceBlocks
    ) -> tuple[PreparedWrite | None, XferHandle | None]:
        """(the prepared write for exactly this request and source, or None; a handle prepared
        for something else, to release, or None)."""
        write = self._writes.pop((key, request.instance_rank), None)
        if write is None:
            return None, None
        if write.request != request or write.source != source:
            return None, write.handle
        return write, None

    def posted(self, key: int, rank: int) -> None:
        """The write prepared for gen rank `rank` of `key` was posted: no longer ours to
        release (its poll hands the handle back)."""
        self._writes.pop((key, rank), None)

    def drop_requests_of(self, instance_name: str) -> list[XferHandle]:
        """Forget the writes prepared for requests of the gen instance `instance_name` (gone);
        the handles to release."""
        keys = [k for k, w in self._writes.items() if w.request.instance_name == instance_name]
        return [self._writes.pop(k).handle for k in keys]

    def drop(self, key: int) -> list[XferHandle]:
        """Forget `key` (answered, cancelled, refused); the handles to release."""
        self._expected.pop(key, None)
        ranks = [rank for k, rank in self._writes if k == key]
        return [self._writes.pop((key, rank)).handle for rank in ranks]

    def expired(self, now: float) -> list[XferHandle]:
        """Forget the keys whose expectation is past its deadline (the KV never came)."""
        handles: list[XferHandle] = []
        for key in [k for k, e in self._expected.items() if now >= e.deadline]:
            handles += self.drop(key)
        return handles
