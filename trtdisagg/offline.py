"""The offline engine: `LLM(model, **worker_config).generate(prompts, sampling_params)`.

The same engine as a worker's (`build_runner`, `assemble_executor`: the scheduler, the step loop,
the runner, the output processor), without HTTP and without a transceiver. `generate` puts every
prompt into the executor's inbox at once and runs the loop until each request is done
(`StepLoop.run_until_idle`) inside a `trio.run` of its own, so it blocks and returns the
requests' outputs in the prompts' order. Keyword arguments are worker config keys (DESIGN.md §4;
`device="cuda"`, `dtype="bfloat16"`, `max_batch_size=...`), checked as a config file's are.

One rank only: tensor- and pipeline-parallel instances serve through `python -m trtdisagg`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
import trio

from trtdisagg.api.protocol import PerfMetrics
from trtdisagg.config import ConfigError, WorkerConfig, structure
from trtdisagg.cpu_affinity import CpuAffinityError, pin_engine
from trtdisagg.errors import CapacityError
from trtdisagg.metrics import WorkerMetrics
from trtdisagg.model.loader import resolve_model
from trtdisagg.model.parallel import Parallel
from trtdisagg.worker.engine.build import assemble_executor
from trtdisagg.worker.engine.executor import Executor, RequestHandle
from trtdisagg.worker.engine.wakeup import Wakeup
from trtdisagg.worker.request import Request, SamplingParams
from trtdisagg.worker.runner import ModelRunner, build_runner
from trtdisagg.worker.token_logprobs import TokenLogprobs
from trtdisagg.worker.tokenization import Tokenizer

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

Prompt = str | Sequence[int]


@attrs.frozen(kw_only=True)
class CompletionOutput:
    """One generated sequence."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...] | None  # one per token, when asked for
    finish_reason: str | None  # "stop", "length", "abort", "error"


@attrs.frozen(kw_only=True)
class RequestOutput:
    """One prompt's result: its tokens and its generated sequence(s) (vLLM's shape), with the
    first sequence's fields at the top level for convenience."""

    request_id: int
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    perf: PerfMetrics | None = None  # queue, prefill, first token and decode times

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> tuple[TokenLogprobs | None, ...] | None:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class LLM:
    """An engine in this process. Building it loads the model, sizes the KV pool and, on CUDA,
    compiles the kernels and captures the graphs: seconds to minutes, once."""

    def __init__(self, model: str, **worker_config: object) -> None:
        try:
            config = structure({"model": model, **worker_config}, WorkerConfig, source="LLM")
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if config.world_size != 1:
            raise ValueError(
                "LLM runs one rank: tensor_parallel_size and pipeline_parallel_size must be 1 "
                "(serve multi-rank instances with `python -m trtdisagg`)"
            )
        if config.cpu_affinity is not None:  # this process, as a worker's engine process
            try:
                pin_engine(config.cpu_affinity, 1, threads=config.cpu_threads)
            except CpuAffinityError as exc:
                raise ValueError(f"cpu_affinity: {exc}") from None
        model_dir = resolve_model(config.model)
        self.config = config
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.runner: ModelRunner = build_runner(
            config, model_dir, Parallel(device_index=config.cuda_device)
        )
        self.executor: Executor = assemble_executor(
            config,
            runner=self.runner,
            tokenizer=self.tokenizer,
            metrics=WorkerMetrics.create(),
            wakeup=Wakeup(),
        )
        self._next_id = 0

    @property
    def max_seq_len(self) -> int:
        return self.executor.max_seq_len

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or a list of either) and
        return their outputs in order. `sampling_params` is one for all or one per prompt;
        None is `SamplingParams(max_tokens=16)` (temperature 1). Blocks until all are done.

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, a prompt with
                `max_tokens` longer than the model's context, or mismatched lengths.
        """
        batch = _as_batch(prompts)
        params = _params_for(batch, sampling_params)
        requests = [self._request(i, p, sp) for i, (p, sp) in enumerate(zip(batch, params))]
        return trio.run(self._run, batch, requests)

    async def _run(
        self, prompts: Sequence[Prompt], requests: Sequence[Request]
    ) -> list[RequestOutput]:
        handles = [self.executor.submit(request) for request in requests]
        await self.executor.loop.run_until_idle()
        return [
            self._collect(prompt, handle) for prompt, handle in zip(prompts, handles, strict=True)
        ]

    def _request(self, index: int, prompt: Prompt, params: SamplingParams) -> Request:
        where = f"prompts[{index}]"
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"{where}: must not be empty")
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{where}: token id {bad} outside the vocabulary [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_seq_len:
            raise ValueError(
                f"{where}: {len(ids)} prompt tokens + max_tokens {params.max_tokens} exceed "
                f"the model's context of {self.max_seq_len} tokens"
            )
        self._next_id += 1
        request = Request(
            request_id=self._next_id,
            prompt_token_ids=ids,
            sampling=params,
            arrival_time=time.monotonic(),
        )
        try:
            self.executor.check_fits(request)
        except CapacityError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return request

    def _collect(self, prompt: Prompt, handle: RequestHandle) -> RequestOutput:
        tokens: list[int] = []
        texts: list[str] = []
        logprobs: list[TokenLogprobs | None] = []
        reason = None
        perf = None
        while True:
            try:
                out = handle.outputs.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            tokens.extend(out.token_ids)
            texts.append(out.text)
            logprobs.extend(out.logprobs)
            if out.finish_reason is not None:
                reason = out.finish_reason.value
                perf = out.perf
            if out.error is not None:
                raise RuntimeError(f"request {handle.request.request_id} failed: {out.error}")
        request = handle.request
        wants = request.sampling.logprobs is not None
        completion = CompletionOutput(
            index=0,
            text="".join(texts),
            token_ids=tuple(tokens),
            logprobs=tuple(logprobs) if wants else None,
            finish_reason=reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=tuple(request.prompt_token_ids),
            outputs=(completion,),
            perf=perf,
        )


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string or one list of ids) or a list of prompts, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    batch: list[Prompt] = []
    ids: list[int] = []
    for prompt in prompts:
        if isinstance(prompt, int):
            ids.append(prompt)
        else:
            batch.append(prompt)
    if ids and batch:
        raise ValueError("prompts: token ids and prompts mixed in one list")
    return [ids] if ids else batch


def _params_for(
    prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams(max_tokens=16)] * len(prompts)
    if isinstance(params, SamplingParams):
        return [params] * len(prompts)
    listed = list(params)
    if len(listed) != len(prompts):
        raise ValueError(
            f"sampling_params: {len(listed)} given for {len(prompts)} prompts (give one, or "
            "one per prompt)"
        )
    return listed
