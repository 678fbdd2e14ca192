"""The router interface and the bookkeeping every router shares. Pure: no I/O, no tasks.

A router picks one server of a role (context or generation) for a request and tracks what it
placed there until the request finishes:

1. `update_servers(views)`: the healthy servers, from the cluster state (health checks).
2. `select(request, exclude=..., pairing=...)`: choose, and reserve load on the choice under
   `request.key`. `pairing` names the server already chosen for the request's other leg and the
   servers of this role that cannot exchange KV with it: those are never chosen.
3. `finish(key, success=...)`: release that reservation. Exactly once per successful select; a
   second finish, or one for an unknown key, is a no-op (callers release in `finally`).

Selecting again under a key that still holds a reservation first releases the old one, so a
retry can never leak load. The KV-aware router is also fed `apply_kv_events(url, events)`, the
events its shell drains from each worker's ``POST /kv_cache_events``.
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import attrs

from trtdisagg.coordinator.config import RouterConfig, RouterType
from trtdisagg.errors import TrtDisaggError


class NoServerAvailable(TrtDisaggError):
    """No healthy server of the role is left to choose (HTTP 503)."""


@attrs.frozen(kw_only=True)
class ServerView:
    """What a router knows about one healthy server (from its ``/server_info``)."""

    url: str
    max_batch_size: int | None = None
    tokens_per_block: int | None = None


@attrs.frozen(kw_only=True)
class RouteRequest:
    """The routing-relevant part of one request attempt."""

    key: int
    """Reservation key: the attempt's disagg_request_id (a retry has a new one)."""
    prompt_token_ids: tuple[int, ...] | None = None
    """The prompt as the worker will tokenize it, when the coordinator could tokenize it."""
    prompt_text: str | None = None
    """The prompt text (chat: the messages' text), used when token ids are unknown."""
    conversation_id: str | None = None
    cache_salt: str | None = None
    """Its prefix cache's salt (`kv.hashing.salt_root`): it matches only blocks of that salt."""

    @property
    def weight(self) -> int:
        """Load the request adds: prompt tokens, else prompt characters, else 1."""
        if self.prompt_token_ids is not None:
            return max(len(self.prompt_token_ids), 1)
        if self.prompt_text is not None:
            return max(len(self.prompt_text), 1)
        return 1


@attrs.frozen(kw_only=True)
class Pairing:
    """The server chosen for the request's other leg, and who cannot pair with it."""

    peer: str
    incompatible: Mapping[str, str] = attrs.Factory(dict)
    """url -> why that server cannot exchange KV with `peer` (the reason names both values)."""


@attrs.frozen(kw_only=True)
class Selection:
    server: str
    matched_tokens: int = 0
    """Prompt tokens the router expects the server to hold in its prefix cache."""


@attrs.frozen(kw_only=True)
class KvEvent:
    """One entry of a worker's ``POST /kv_cache_events`` answer."""

    event_id: int
    kind: Literal["stored", "removed"]
    block_hashes: tuple[int, ...]
    parent_hash: int | None = None


def parse_kv_events(data: object) -> list[KvEvent]:
    """Validate a ``/kv_cache_events`` JSON body.

    Raises:
        ValueError: the body is not a list of well-formed events (the message says which).
    """
    if not isinstance(data, list):
        raise ValueError(f"kv_cache_events: expected a list, got {type(data).__name__}")
    events = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"kv_cache_events[{i}]: expected an object")
        kind = item.get("kind")
        hashes = item.get("block_hashes")
        event_id = item.get("event_id")
        parent = item.get("parent_hash")
        if kind not in ("stored", "removed"):
            raise ValueError(f"kv_cache_events[{i}].kind: expected stored or removed, got {kind!r}")
        if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
            raise ValueError(f"kv_cache_events[{i}].block_hashes: expected a list of integers")
        if not isinstance(event_id, int) or (parent is not None and not isinstance(parent, int)):
            raise ValueError(f"kv_cache_events[{i}]: bad event_id or parent_hash")
        events.append(
            KvEvent(event_id=event_id, kind=kind, block_hashes=tuple(hashes), parent_hash=parent)
        )
    return events


@attrs.frozen(kw_only=True)
class RouterStatistics:
    router: str
    servers: tuple[str, ...]
    active_requests: dict[str, int]
    active_tokens: dict[str, int]


@attrs.frozen(kw_only=True)
class _Reservation:
    server: str
    weight: int


class Router(abc.ABC):
    """Base class: candidate filtering, reservations, load counters, round-robin tie-breaks."""

    type: ClassVar[RouterType]
    needs_kv_events: ClassVar[bool] = False
    """True when the shell should feed `apply_kv_events` from the workers."""

    def __init__(self, config: RouterConfig, *, role: str) -> None:
        self.config = config
        self.role = role
        self._servers: list[ServerView] = []
        self._reservations: dict[int, _Reservation] = {}
        self._active_requests: Counter[str] = Counter()
        self._active_tokens: Counter[str] = Counter()
        self._turns = 0
        self._chosen: dict[str, int] = {}  # url -> the turn `_round_robin` last chose it

    @property
    def uses_prompt_tokens(self) -> bool:
        """True when routing is better with the prompt's token ids (the shell then tokenizes)."""
        return False

    @property
    def servers(self) -> list[ServerView]:
        return list(self._servers)

    def update_servers(self, servers: Sequence[ServerView]) -> None:
        """Replace the set of healthy servers. Reservations on removed servers stay until
        finished, so their load is right if the server comes back."""
        self._servers = list(servers)

    def reset_server(self, url: str) -> None:
        """Forget what is known about a server's cache (it restarted). Default: nothing."""
        return None

    def apply_kv_events(self, url: str, events: Sequence[KvEvent]) -> None:
        """Feed KV cache events drained from one server. Default: ignored."""
        return None

    def select(
        self,
        request: RouteRequest,
        *,
        exclude: str | None = None,
        pairing: Pairing | None = None,
    ) -> Selection:
        """Choose a server and reserve the request's load on it.

        Raises:
            NoServerAvailable: no healthy server, or none left once `exclude` and the servers
                that cannot pair with `pairing.peer` are left out (the message says which).
        """
        if request.key in self._reservations:
            self.finish(request.key, success=False)
        unpairable = pairing.incompatible if pairing is not None else {}
        pairable = [s for s in self._servers if s.url not in unpairable]
        candidates = [s for s in pairable if s.url != exclude]
        if not candidates:
            raise NoServerAvailable(self._none_left(exclude, pairing, pairable))
        selection = self._choose(candidates, request)
        weight = request.weight
        self._reservations[request.key] = _Reservation(server=selection.server, weight=weight)
        self._active_requests[selection.server] += 1
        self._active_tokens[selection.server] += weight
        return selection

    def finish(self, key: int, *, success: bool = True) -> str | None:
        """Release the reservation of `key`; returns its server, or None if there was none."""
        reservation = self._reservations.pop(key, None)
        if reservation is None:
            return None
        self._active_requests[reservation.server] -= 1
        self._active_tokens[reservation.server] -= reservation.weight
        if self._active_requests[reservation.server] <= 0:
            del self._active_requests[reservation.server]
            self._active_tokens.pop(reservation.server, None)
        self._on_finish(key, reservation.server, success=success)
        return reservation.server

    def _none_left(
        self, exclude: str | None, pairing: Pairing | None, pairable: list[ServerView]
    ) -> str:
        if not self._servers:
            return f"no {self.role} servers available"
        if pairing is not None and not pairable:
            why = "; ".join(f"{s.url}: {pairing.incompatible[s.url]}" for s in self._servers)
            return f"no {self.role} server can exchange KV with {pairing.peer}: {why}"
        also = ""
        if pairing is not None and len(pairable) < len(self._servers):
            also = f" and those that cannot exchange KV with {pairing.peer}"
        return f"no {self.role} servers left after excluding {exclude}{also}"

    def active_requests(self, url: str) -> int:
        return self._active_requests[url]

    def statistics(self) -> RouterStatistics:
        return RouterStatistics(
            router=self.type.value,
            servers=tuple(s.url for s in self._servers),
            active_requests={s.url: self._active_requests[s.url] for s in self._servers},
            active_tokens={s.url: self._active_tokens[s.url] for s in self._servers},
        )

    @abc.abstractmethod
    def _choose(self, candidates: list[ServerView], request: RouteRequest) -> Selection:
        """Pick one of `candidates` (never empty)."""

    def _on_finish(self, key: int, server: str, *, success: bool) -> None:
        """Hook for subclasses; called after the load was released."""
        return None

    def _round_robin(self, tied: Sequence[ServerView]) -> ServerView:
        """The one of `tied` chosen least recently (never chosen first, in list order).

        Not a counter over `tied`: candidates differ from one request to the next (`exclude`,
        `pairing`), and a counter, or a turn through the server list, can keep landing on the
        same one: two groups of sizes 2 and 1 taking turns would send all of the first group's
        requests to its first server.
        """
        choice = min(tied, key=lambda s: self._chosen.get(s.url, -1))
        self._turns += 1
        self._chosen[choice.url] = self._turns
        return choice
