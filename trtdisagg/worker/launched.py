"""A launched step's results: its sampled tokens on the device, and their one copy to the host.

`ModelRunner.launch` queues a step's forward and sampling and returns a `LaunchedStep`: the
sampled tokens stay on the device (the next step's decode rows read them there) and one
non-blocking copy brings them to pinned host memory, after which an event is recorded.
`ModelRunner.finish` waits for that event (a driver does it off the Trio loop) and turns the
host copy into `StepOutput`. On CPU everything is done when `launch` returns.

Two CUDA events with timing bracket the step's device work (forward and sampling), so a caller
can sum the device's busy time (`StepOutput.device_s`) without synchronising anything more.
"""

from __future__ import annotations

import time

import attrs
import torch

from trtdisagg.worker.sampling import TokenLogprobs


@attrs.frozen(kw_only=True)
class Sampled:
    request_id: int
    token_id: int
    logprobs: TokenLogprobs | None


@attrs.frozen(kw_only=True, eq=False)
class StepOutput:
    sampled: tuple[Sampled, ...]
    forward_s: float  # host time of the step's launch (on CPU: the whole forward)
    device_s: float = 0.0  # device time of its forward and sampling (CUDA events; CPU: forward_s)


@attrs.define(eq=False, kw_only=True)
class LaunchedStep:
    """One step queued on the device (or done, on CPU)."""

    request_ids: tuple[int, ...]  # the rows of `tokens`: the requests that sample in the step
    tokens: torch.Tensor  # int64 [S] on the model's device: what the next step's late rows read
    logprobs: tuple[TokenLogprobs | None, ...]  # per row (already on the host)
    forward_s: float
    host: torch.Tensor | None = None  # pinned copy of `tokens` (CUDA), valid once `ready` fired
    ready: torch.cuda.Event | None = None
    started: torch.cuda.Event | None = None  # timing events around the device work
    ended: torch.cuda.Event | None = None

    @classmethod
    def queue(
        cls,
        request_ids: tuple[int, ...],
        tokens: torch.Tensor,
        logprobs: tuple[TokenLogprobs | None, ...],
        *,
        launched_at: float,
        started: torch.cuda.Event | None,
    ) -> LaunchedStep:
        """Start the tokens' copy to the host (CUDA: non-blocking, into pinned memory)."""
        if tokens.device.type != "cuda":
            return cls(
                request_ids=request_ids,
                tokens=tokens,
                logprobs=logprobs,
                forward_s=time.perf_counter() - launched_at,
            )
        ended = None
        if started is not None:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(
            request_ids=request_ids,
            tokens=tokens,
            logprobs=logprobs,
            forward_s=time.perf_counter() - launched_at,
            host=host,
            ready=ready,
            started=started,
            ended=ended,
        )

    @property
    def done(self) -> bool:
        """Whether the tokens are on the host (never blocks)."""
        return self.ready is None or self.ready.query()

    def wait(self) -> None:
        """Block this thread until the tokens are on the host (a no-op on CPU)."""
        if self.ready is not None:
            self.ready.synchronize()

    def output(self) -> StepOutput:
        """The sampled tokens, per request; call after `wait`."""
        host = self.host if self.host is not None else self.tokens
        tokens = host.tolist() if self.request_ids else []
        device_s = self.forward_s
        if self.started is not None and self.ended is not None:
            device_s = self.started.elapsed_time(self.ended) / 1000.0
        sampled = tuple(
            Sampled(request_id=request_id, token_id=int(token), logprobs=lp)
            for request_id, token, lp in zip(self.request_ids, tokens, self.logprobs, strict=True)
        )
        return StepOutput(sampled=sampled, forward_s=self.forward_s, device_s=device_s)
