"""A launched step's results: its sampled tokens on the device, and their one copy to the host.

`ModelRunner.launch` queues a step's forward and sampling and returns a `LaunchedStep`: the
sampled tokens stay on the device (the next step's decode rows read them there) and one
non-blocking copy brings them, with any logprobs, to pinned host memory, after which an event is
recorded (`sampling.PendingSample`). `ModelRunner.finish` waits for that event (a driver does it
off the Trio loop) and turns the host copy into `StepOutput`. On CPU everything is done when
`launch` returns.

Two CUDA events with timing bracket the step's device work (forward and sampling), so a caller
can sum the device's busy time (`StepOutput.device_s`) without synchronising anything more.
"""

from __future__ import annotations

import time

import attrs
import torch

from trtdisagg.worker.prompt_logprobs import PromptLogprobs
from trtdisagg.worker.sampling import PendingSample
from trtdisagg.worker.token_logprobs import TokenLogprobs


@attrs.frozen(kw_only=True)
class Sampled:
    request_id: int
    token_id: int
    logprobs: TokenLogprobs | None
    choice: int = 0  # i > 0: the first token of fork i of the request (`SampleSpec.forks`)


@attrs.frozen(kw_only=True, eq=False)
class StepOutput:
    sampled: tuple[Sampled, ...]
    forward_s: float  # host time of the step's launch (on CPU: the whole forward)
    device_s: float = 0.0  # device time of its forward and sampling (CUDA events; CPU: forward_s)
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()


@attrs.define(eq=False, kw_only=True)
class LaunchedStep:
    """One step queued on the device (or done, on CPU)."""

    rows: tuple[tuple[int, int], ...]  # (request id, choice) of each token it samples
    tokens: torch.Tensor  # int64 [S] on the model's device: what the next step's late rows read
    pending: PendingSample  # the same tokens (and logprobs) on their way to the host
    forward_s: float
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    started: torch.cuda.Event | None = None  # timing events around the device work
    ended: torch.cuda.Event | None = None

    @classmethod
    def queue(
        cls,
        rows: tuple[tuple[int, int], ...],
        pending: PendingSample,
        *,
        launched_at: float,
        started: torch.cuda.Event | None,
        prompt_logprobs: tuple[PromptLogprobs, ...] = (),
    ) -> LaunchedStep:
        ended = None
        if started is not None:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
        return cls(
            rows=rows,
            tokens=pending.device_tokens,
            pending=pending,
            forward_s=time.perf_counter() - launched_at,
            prompt_logprobs=prompt_logprobs,
            started=started,
            ended=ended,
        )

    @property
    def done(self) -> bool:
        """Whether the tokens are on the host (never blocks)."""
        ready = self.pending.ready
        return ready is None or ready.query()

    def wait(self) -> None:
        """Block this thread until the tokens are on the host (a no-op on CPU)."""
        if self.pending.ready is not None:
            self.pending.ready.synchronize()

    def output(self) -> StepOutput:
        """The sampled tokens, per request and choice; call after `wait`."""
        tokens, logprobs = self.pending.result() if self.rows else ([], [])
        device_s = self.forward_s
        if self.started is not None and self.ended is not None:
            device_s = self.started.elapsed_time(self.ended) / 1000.0
        sampled = tuple(
            Sampled(request_id=request_id, token_id=token, logprobs=lp, choice=choice)
            for (request_id, choice), token, lp in zip(self.rows, tokens, logprobs, strict=True)
        )
        return StepOutput(
            sampled=sampled,
            forward_s=self.forward_s,
            device_s=device_s,
            prompt_logprobs=self.prompt_logprobs,
        )
