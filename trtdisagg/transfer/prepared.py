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

from trtdisagg.transfer.protocol.fragments import Fragments
from trtdisagg.transfer.protocol.sessions import SourceBlocks
from trtdisagg.transfer.protocol.wire import NoticeTemplate, RequestData
from trtdisagg.transfer.runtime.agents.base import XferHandle


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
    """Expected sources by transfer key, and the writes prepared from them by (key, gen rank).

    A key is `safe` once its writes were prepared and the caller found that the session made
    when the KV is ready will take every request they answer (transfer/send_side.py): that
    moment is the one that decides how soon the bytes move, so the check is made while the
    prefill runs. Anything that changes what is held for the key (a new request, a write added
    or dropped, a new expectation) makes it unsafe until the caller checks again.
    """

    _expected: dict[int, _Expected] = attrs.field(factory=dict)
    _writes: dict[int, dict[int, PreparedWrite]] = attrs.field(factory=dict)  # key -> rank ->
    _safe: set[int] = attrs.field(factory=set)

    def __len__(self) -> int:
        """Writes prepared and not yet taken or dropped."""
        return sum(map(len, self._writes.values()))

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
        (to release), if any. The key is unsafe until `mark_safe`."""
        self._safe.discard(key)
        writes = self._writes.setdefault(key, {})
        old = writes.get(write.request.instance_rank)
        writes[write.request.instance_rank] = write
        return None if old is None else old.handle

    def mark_safe(self, key: int) -> None:
        """The caller checked that the session made for `key` will take what is held for it."""
        if key in self._writes:
            self._safe.add(key)

    def unsafe(self, key: int) -> None:
        """Something changed what is held for `key`: check again before posting."""
        self._safe.discard(key)

    def is_safe(self, key: int) -> bool:
        return key in self._safe

    def ready(self, key: int, source: SourceBlocks) -> list[PreparedWrite]:
        """The writes prepared for `key` from exactly `source` (left in place)."""
        writes = self._writes.get(key)
        if not writes:
            return []
        return [w for w in writes.values() if w.source == source]

    def take(
        self, key: int, request: RequestData, source: SourceBlocks
    ) -> tuple[PreparedWrite | None, XferHandle | None]:
        """(the prepared write for exactly this request and source, or None; a handle prepared
        for something else, to release, or None)."""
        write = self._pop(key, request.instance_rank)
        if write is None:
            return None, None
        if write.request != request or write.source != source:
            return None, write.handle
        return write, None

    def posted(self, key: int, rank: int) -> None:
        """The write prepared for gen rank `rank` of `key` was posted: no longer ours to
        release (its poll hands the handle back)."""
        self._pop(key, rank)

    def _pop(self, key: int, rank: int) -> PreparedWrite | None:
        writes = self._writes.get(key)
        if writes is None:
            return None
        write = writes.pop(rank, None)
        if not writes:
            del self._writes[key]
            self._safe.discard(key)
        return write

    def drop_requests_of(self, instance_name: str) -> list[XferHandle]:
        """Forget the writes prepared for requests of the gen instance `instance_name` (gone);
        the handles to release."""
        handles: list[XferHandle] = []
        for key, writes in list(self._writes.items()):
            ranks = [r for r, w in writes.items() if w.request.instance_name == instance_name]
            if ranks:
                self._safe.discard(key)
            handles += [write.handle for rank in ranks if (write := self._pop(key, rank))]
        return handles

    def drop(self, key: int) -> list[XferHandle]:
        """Forget `key` (answered, cancelled, refused); the handles to release."""
        self._expected.pop(key, None)
        self._safe.discard(key)
        return [write.handle for write in self._writes.pop(key, {}).values()]

    def expired(self, now: float) -> list[XferHandle]:
        """Forget the keys whose expectation is past its deadline (the KV never came)."""
        handles: list[XferHandle] = []
        for key in [k for k, e in self._expected.items() if now >= e.deadline]:
            handles += self.drop(key)
        return handles
