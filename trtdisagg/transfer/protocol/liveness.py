"""Which peer instances are gone (docs/LIFECYCLE.md, "Peers that are gone", tells why). Pure.

A live or stalled process keeps its sockets open: a peer replaced at its endpoint, or whose link
stayed down, is `dead` and what waits on it fails at once; a silent one may be stalled and write
later.
"""

from __future__ import annotations

import attrs

# A dropped connection that a live peer re-makes (zmq reconnects within ~0.1 s) against a
# process that ended: its port refuses connections until a new process binds it.
RELINK_S = 1.0


@attrs.frozen
class Gone:
    """A peer instance to forget, and why. `dead`: it can write nothing any more."""

    instance: str
    dead: bool
    reason: str


@attrs.define
class _Peer:
    endpoint: str  # rank 0's control endpoint: where probes go
    heard: float
    probed: float | None = None  # the probe awaiting an answer
    misses: int = 0
    down: dict[str, float] = attrs.field(factory=dict)  # rank endpoint -> when its link dropped
    recheck: bool = False  # probe at once (a link came back: maybe to a new process)
    replaced: bool = False  # another instance answers at its endpoint


@attrs.define
class PeerLiveness:
    """The peer instances one rank knows, by name, and when each was last heard from."""

    # A live peer answers a probe within milliseconds; these leave room for a peer whose loop is
    # busy (a long prefill step's thread competes for the interpreter) and still release a dead
    # peer's GPU memory within half a minute, before a restarted worker on that GPU sizes its pool.
    idle_s: float = 5.0
    answer_s: float = 5.0
    misses: int = 3
    relink_s: float = RELINK_S
    _peers: dict[str, _Peer] = attrs.field(factory=dict)
    _links: dict[str, str] = attrs.field(factory=dict)  # rank control endpoint -> instance

    def __len__(self) -> int:
        return len(self._peers)

    def track(self, instance: str, endpoint: str, now: float, *, rank0: bool = True) -> None:
        """Watch `instance`: the control connection to `endpoint`, one of its ranks', counts
        for it (`link`); `rank0`: probes go there (again: heard now)."""
        self._links[endpoint] = instance
        if not rank0:
            return
        if (peer := self._peers.get(instance)) is None:
            self._peers[instance] = _Peer(endpoint=endpoint, heard=now)
        else:
            peer.endpoint = endpoint
            self.heard(instance, now)

    def forget(self, instance: str) -> None:
        self._peers.pop(instance, None)
        for endpoint in [e for e, name in self._links.items() if name == instance]:
            del self._links[endpoint]

    def link(self, endpoint: str, up: bool, now: float) -> None:
        """Our control connection to `endpoint` came up, or dropped or failed to connect
        (endpoints of no tracked instance are ignored)."""
        peer = self._peers.get(self._links.get(endpoint, ""))
        if peer is None:
            return
        if not up:
            peer.down.setdefault(endpoint, now)
        elif peer.down.pop(endpoint, None) is not None:
            peer.recheck = True

    def heard(self, instance: str, now: float) -> None:
        """A message from `instance`: alive (untracked names are ignored)."""
        peer = self._peers.get(instance)
        if peer is not None:
            peer.heard = max(peer.heard, now)
            peer.probed = None
            peer.misses = 0

    def answered(self, endpoint: str, instance: str, now: float) -> None:
        """rank 0 at `endpoint` says it is `instance`: that one is alive, and any other tracked
        instance whose rank 0 was there is gone (a restart on the same port)."""
        for name, peer in self._peers.items():
            if peer.endpoint != endpoint:
                continue
            if name == instance:
                self.heard(name, now)
            else:
                peer.replaced = True

    def to_probe(self, now: float) -> list[tuple[str, str]]:
        """(instance, endpoint) to probe now: silent for `idle_s`, or whose last probe went
        unanswered for `answer_s` (a miss). Each call marks them probed at `now`."""
        due = []
        for name, peer in self._peers.items():
            if peer.replaced:
                continue
            if peer.recheck:
                peer.recheck = False
            elif peer.probed is not None:
                if now - peer.probed < self.answer_s:
                    continue
                peer.misses += 1
                if peer.misses >= self.misses:
                    continue  # gone: `gone` says so
            elif now - peer.heard < self.idle_s:
                continue
            peer.probed = now
            due.append((name, peer.endpoint))
        return due

    def gone(self, now: float) -> list[Gone]:
        """Instances replaced at their endpoint, whose connection to a rank dropped `relink_s`
        ago and has not come back (both dead), or that missed `misses` probes in a row (the
        last one unanswered for `answer_s`); the caller forgets them."""
        out: list[Gone] = []
        for name, peer in self._peers.items():
            lost = [e for e, at in sorted(peer.down.items()) if now - at >= self.relink_s]
            missed = peer.misses + (peer.probed is not None and now - peer.probed >= self.answer_s)
            if peer.replaced:
                out.append(Gone(name, True, "a new instance answers at its endpoint"))
            elif lost:
                # (a connection that never came up was refused: nothing listened there)
                dropped = f"its connection to {lost[0]} dropped (or was refused)"
                out.append(
                    Gone(name, True, f"{dropped} and was not back within {self.relink_s:g}s")
                )
            elif peer.probed is not None and missed >= self.misses:
                out.append(Gone(name, False, f"{missed} probes in a row went unanswered"))
        return out
