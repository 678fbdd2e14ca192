"""How a request ends, as data: the one description every ending path hands to the loop (pure).

Whatever ends a request (its last token, a client's abort, a failed model step, a KV transfer
that could not come, the scheduler dropping it), the loop ends it the same way
(`StepLoop.end`): it settles the request's blocks and transfer as `Ending.blocks` says, sends
the final output, closes the request's output channel and counts it. Only the reason differs,
and the reason is this value.
"""

from __future__ import annotations

import enum

import attrs

from trtdisagg.worker.request import FinishReason


class Blocks(enum.Enum):
    """What becomes of an ending request's KV blocks and of its transfer."""

    FREE = "free"
    """Free them now, wherever the request is: a gen request whose KV is still landing cancels
    its receive first, and its blocks stay held until no write can reach them; a ctx request
    whose KV will never be sent tells gen so (`abandon_send`)."""
    SEND = "send"
    """ctx: the request's prefill is done and its answer goes out; pin its blocks and send its
    KV to the gen that asks for it. The transfer frees them once it is final."""
    SETTLED = "settled"
    """Nothing left to do: whoever ended the request settled its blocks already (the scheduler
    dropping it, the transfer tracker freeing or quarantining a failed receive)."""


# Why a context_only request ended without sending its KV, as gen's error says it.
_NOT_SENT: dict[FinishReason, str] = {
    FinishReason.ABORT: "it was aborted",
    FinishReason.ERROR: "it failed",
    FinishReason.STOP: "it finished at its first token (stop), so there is nothing to decode",
    FinishReason.LENGTH: "it finished at its first token (length), so there is nothing to decode",
}


@attrs.frozen(kw_only=True)
class Ending:
    """Why and how one request ends."""

    reason: FinishReason
    error: str | None = None
    # With `error`: the worker's own failure (a model step raised), a 500 even on gen, where an
    # error otherwise means the KV could not come from ctx (502).
    internal: bool = False
    blocks: Blocks = Blocks.FREE

    @classmethod
    def finished(cls, reason: FinishReason) -> Ending:
        """The request's last token is out (a stop rule or its length)."""
        return cls(reason=reason)

    @classmethod
    def handed_over(cls) -> Ending:
        """ctx: a context_only request's first token is out; gen decodes the rest."""
        return cls(reason=FinishReason.STOP, blocks=Blocks.SEND)

    @classmethod
    def aborted(cls) -> Ending:
        """Its client went away."""
        return cls(reason=FinishReason.ABORT)

    @classmethod
    def failed(cls, error: str) -> Ending:
        """This worker failed it (a model step raised, or the worker stopped serving)."""
        return cls(reason=FinishReason.ERROR, error=error, internal=True)

    @classmethod
    def transfer_failed(cls, error: str) -> Ending:
        """gen: its KV could not come from ctx; the tracker settled its blocks already."""
        return cls(reason=FinishReason.ERROR, error=error, blocks=Blocks.SETTLED)

    @classmethod
    def dropped(cls, reason: FinishReason) -> Ending:
        """The scheduler ended it itself (its KV cannot grow) and freed its blocks."""
        return cls(reason=reason, blocks=Blocks.SETTLED)

    def __attrs_post_init__(self) -> None:
        if (self.error is not None) != (self.reason is FinishReason.ERROR):
            raise ValueError(f"an error ending needs an error and only it: {self!r}")
        if self.internal and self.error is None:
            raise ValueError("only an error can be internal")
        if self.blocks is Blocks.SEND and self.reason is not FinishReason.STOP:
            raise ValueError(f"only a request that ends well sends its KV, not {self.reason}")

    @property
    def status(self) -> str:
        """The `status` label of `trtdisagg_requests_total`."""
        return {FinishReason.ABORT: "aborted", FinishReason.ERROR: "error"}.get(self.reason, "ok")

    @property
    def why_not_sent(self) -> str:
        """Why a context_only request ending so never sends its KV, as gen's error says it."""
        return _NOT_SENT.get(self.reason, f"it ended ({self.reason.value})")
