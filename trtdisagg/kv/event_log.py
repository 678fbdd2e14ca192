"""The KV event log: a worker's last prefix-cache events, for any number of readers (pure).

A KV-aware router learns which prefixes a worker holds from these events. A reader either
drains them (`drain`: every event since the last drain, what `POST /kv_cache_events` with no
body answers) or keeps a cursor of its own (`after`: the events after the last id it saw). The
front ends of a coordinator fleet each poll every worker with a cursor, so each reads every
event and none takes events from another, as a drain would.

Ids count up by one per event. The log keeps the last `capacity` events: a reader whose cursor
fell further behind gets events that start past its cursor + 1, and one whose cursor is past
the newest id (it read a previous run of this worker) gets every event kept, whose first id is
at most its cursor. Either way it learns that its view of the worker is incomplete and starts
it over from what it gets.
"""

from __future__ import annotations

import collections
import enum

import attrs


class KvEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@attrs.frozen(kw_only=True)
class KvEvent:
    """A change to the set of cached block hashes, for a KV-aware router.

    ``block_hashes`` of a STORED event are one chain, in order; ``parent_hash`` is the hash of the
    block before the first of them (None if the chain starts at the sequence's first block).
    REMOVED events have no parent. ``event_id`` increases by one per event, so a consumer can
    tell when it missed some.
    """

    kind: KvEventKind
    block_hashes: tuple[int, ...]
    parent_hash: int | None = None
    event_id: int


class KvEventLog:
    """The last `capacity` KV events, a drain position, and how many events a drain missed."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"the KV event log's capacity must be positive, got {capacity}")
        self._events: collections.deque[KvEvent] = collections.deque(maxlen=capacity)
        self._next_id = 0
        self._drained_to = -1  # the id of the last event a drain returned
        self.num_dropped = 0  # events that left the log before any drain returned them

    def append(self, kind: KvEventKind, hashes: tuple[int, ...], parent: int | None) -> None:
        events = self._events
        if len(events) == events.maxlen and events[0].event_id > self._drained_to:
            self.num_dropped += 1
        events.append(
            KvEvent(kind=kind, block_hashes=hashes, parent_hash=parent, event_id=self._next_id)
        )
        self._next_id += 1

    def drain(self) -> list[KvEvent]:
        """The events no drain returned yet, oldest first."""
        out = self.after(self._drained_to)
        if out:
            self._drained_to = out[-1].event_id
        return out

    def after(self, cursor: int) -> list[KvEvent]:
        """The events after id `cursor` still kept (every kept event when `cursor` is past the
        newest id), oldest first; `cursor` -1 reads them all."""
        events = self._events
        if not events:
            return []
        oldest = events[0].event_id
        if cursor >= self._next_id:
            return list(events)
        start = max(0, cursor + 1 - oldest)
        return [events[i] for i in range(start, len(events))]
