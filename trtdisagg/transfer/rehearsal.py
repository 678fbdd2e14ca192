"""gen rehearses its hand-over while it waits for a write, so that the real one runs warm.

Code and data that a process leaves untouched for a few milliseconds fall out of the CPU caches
on the virtual machines we run on (what evicts them we did not find: not our own spin loop).
One hand-over took 216-285 us at p50 on the CI VM after 10 ms of spinning, 34-41 us right after
another, and 43-54 us when a twin rehearsed it every 0.25 ms meanwhile; on the H200 host 37-100,
15-34 and 17-37 us (`tools/cold_path.py`). A gen that waits for a write spins through the whole
last prefill step at ctx, and then ran its hand-over cold: 0.1-0.15 ms there from the
notification to the executor, where a raw NIXL reader takes 0.01 ms.

So while gen spins, it runs the same hand-over every REHEARSE_EVERY_S on a twin of its receiver:
a WRITE_NOTICE is decoded, noticed, ended and checked through the very methods the real one goes
through, on objects that nothing else sees. The twin's callbacks that would reach the outside
(messages, tasks, wake-ups, the agent) are never called on this path, and say so if one is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import attrs

from trtdisagg.transfer.pacing import Watches
from trtdisagg.transfer.protocol.peers import PeerRegistrar
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.sessions import ReceiverSession, SessionRegistry, TransferOutcome
from trtdisagg.transfer.protocol.wire import WriteNotice, decode, encode
from trtdisagg.transfer.receive_side import GenReceiver
from trtdisagg.transfer.rendezvous import CtxPeers

# How often the shell rehearses while it spins: well within how long the code stays cached on
# the CI VM and the device host (see above). A rehearsal takes 17-37 us on the device host and
# 43-54 us on the CI VM, and a notification that lands meanwhile waits for its end.
REHEARSE_EVERY_S = 0.00025
# A key no id generator hands out (global ids stay below it; a client may still pick it, so the
# twin keeps nothing by key outside itself), and a ctx instance name no peer has.
REHEARSAL_KEY = 2**63 - 1
REHEARSAL_PEER = "rehearsal"


class RehearsalEffect(AssertionError):
    """The twin reached a callback with effects: the rehearsal no longer follows the real path."""


def _unused(*_args: Any, **_kwargs: Any) -> NoReturn:
    raise RehearsalEffect("the hand-over rehearsal reached a callback with effects")


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


def _outcome(key: int, *, ok: bool, **fields: Any) -> TransferOutcome:
    """The shell's `_outcome` without its timings and stamps, which are keyed by transfer key:
    a client may pick any key, REHEARSAL_KEY too."""
    return TransferOutcome(key=key, ok=ok, **fields)


@attrs.define(eq=False)
class HandoverRehearsal:
    """A twin of gen's receiver and a WRITE_NOTICE for it: `run` takes one transfer through."""

    twin: GenReceiver
    payload: bytes
    timeout_s: float
    runs: int = 0

    @classmethod
    def of(
        cls, local: RankInfo, *, timeout_s: float, clock: Callable[[], float]
    ) -> HandoverRehearsal:
        """A rehearsal for a gen rank `local`, on the shell's `clock`."""
        registrar = PeerRegistrar(local)
        watches = Watches()
        ctx_peers = CtxPeers(
            local=local,
            registrar=registrar,
            send=_unused,
            drop_dealer=_unused,
            met=_unused,
            replaced=_unused,
        )
        twin = GenReceiver(
            local=local,
            registrar=registrar,
            timeout_s=timeout_s,
            wake=_nothing,
            clock=clock,
            staging=None,
            receivers=SessionRegistry(),
            ctx_peers=ctx_peers,
            dealers={},
            stamp=_nothing,
            spawn=_unused,
            send=_unused,
            start_timing=_unused,
            outcome=_outcome,
            cancel_message=_unused,
            watch=watches.watch,
            forget=watches.forget,
            drain=_nothing,  # the real drain runs at every spin already
            notice_request=_unused,
        )
        notice = WriteNotice(
            key=REHEARSAL_KEY,
            instance_name=REHEARSAL_PEER,
            instance_rank=0,
            num_bytes=1,
            num_descriptors=1,
            first_tokens=(0,),
        )
        return cls(twin=twin, payload=encode(notice), timeout_s=timeout_s)

    def run(self, now: float) -> TransferOutcome:
        """One transfer through the twin, as a single-rank write that gen watched for: its
        session, the notice that ends it, and the check that hands its outcome over."""
        session = ReceiverSession(
            key=REHEARSAL_KEY,
            peer_instance=REHEARSAL_PEER,
            expected=frozenset((0,)),
            deadline=now + self.timeout_s,
        )
        session.mark_requested()
        self.twin.receivers.add(session)
        notice = decode(self.payload)
        if not isinstance(notice, WriteNotice):
            raise RehearsalEffect(f"the rehearsal's notice decoded as {type(notice).__name__}")
        self.twin.on_write_notice(notice)
        outcomes = self.twin.check_gen_transfer_status(early_failures=True)
        if len(outcomes) != 1 or not outcomes[0].ok or len(self.twin.receivers):
            raise RehearsalEffect(f"the rehearsal ended with {outcomes} and a session left")
        self.runs += 1
        return outcomes[0]
