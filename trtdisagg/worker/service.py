"""WorkerService: turns a validated OpenAI request into an executor request and back.

It owns what the HTTP routes need besides parsing: tokenising the prompt or chat, the model-name
and context-length checks, request ids, and assembling outputs into whole or streamed bodies.
A handler that goes away (client disconnect, cancellation) aborts its request, which frees its
blocks at the executor's next step.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from trtdisagg.api.codec import SSE_DONE, single_prompt, sse_event
from trtdisagg.api.errors import ApiError, bad_request
from trtdisagg.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DisaggregatedParams,
    KvRelease,
    PerfMetrics,
    Usage,
)
from trtdisagg.config import WorkerConfig
from trtdisagg.errors import CapacityError, WorkerStopped
from trtdisagg.kv.hashing import HASH_ALGORITHM
from trtdisagg.metrics import WorkerMetrics
from trtdisagg.transfer.protocol.endpoints import is_tcp_endpoint
from trtdisagg.transfer.protocol.rank_info import compat_fields
from trtdisagg.worker import responses
from trtdisagg.worker.executor import Executor, GenerationSource, RequestHandle, RequestOutput
from trtdisagg.worker.handoff import ctx_instance_of, ctx_state
from trtdisagg.worker.request import Request, RequestType, SamplingParams
from trtdisagg.worker.sampling import MIN_TEMPERATURE, TokenLogprobs

if TYPE_CHECKING:
    from trtdisagg.faults.spec import FaultInjector
from trtdisagg.worker.tokenization import Tokenizer

AnyRequest = CompletionRequest | ChatCompletionRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@attrs.frozen(kw_only=True)
class ServerInfo:
    role: str
    model: str
    model_path: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_batch_size: int
    max_num_tokens: int
    tokens_per_block: int
    max_seq_len: int
    kv_hash_algorithm: str
    layout: str
    dtype: str
    version: str
    disaggregated_params: dict[str, str | None]
    # What a peer must match to exchange KV with this worker (`rank_info.compat_fields`); None
    # when cache_transceiver is disabled. The coordinator pairs only matching ctx and gen.
    kv_compat: dict[str, str | int] | None


@attrs.define(eq=False, kw_only=True)
class WorkerService:
    config: WorkerConfig
    served_model_name: str
    model_dir: Path
    tokenizer: Tokenizer
    executor: Executor
    metrics: WorkerMetrics
    max_seq_len: int
    ready: bool = False
    started_at: float = attrs.field(factory=time.time)
    ctx_info_endpoint: str | None = None
    ctx_instance: str | None = None  # this worker's transceiver instance name (handoff.py)
    faults: FaultInjector | None = None  # tests only: armed by TRTDISAGG_FAULTS
    _ids: itertools.count[int] = attrs.field(factory=itertools.count, alias="ids")

    def server_info(self) -> ServerInfo:
        from trtdisagg import __version__

        c = self.config
        return ServerInfo(
            role=c.role.value,
            model=self.served_model_name,
            model_path=str(self.model_dir),
            tensor_parallel_size=c.tensor_parallel_size,
            pipeline_parallel_size=c.pipeline_parallel_size,
            max_batch_size=c.max_batch_size,
            max_num_tokens=c.max_num_tokens,
            tokens_per_block=c.kv_cache_config.tokens_per_block,
            max_seq_len=self.max_seq_len,
            kv_hash_algorithm=HASH_ALGORITHM,
            layout=c.kv_cache_config.layout.value,
            dtype=c.dtype,
            version=__version__,
            disaggregated_params={"ctx_info_endpoint": self.ctx_info_endpoint},
            kv_compat=self._kv_compat(),
        )

    def _kv_compat(self) -> dict[str, str | int] | None:
        transceiver = self.executor.transceiver
        if transceiver is None:
            return None
        return compat_fields(transceiver.local)

    def render_metrics(self) -> bytes:
        return self.metrics.render(self.executor.refresh_gauges)

    def drain_kv_events(self) -> list[dict[str, Any]]:
        return [
            {
                "event_id": e.event_id,
                "kind": e.kind.value,
                "block_hashes": list(e.block_hashes),
                "parent_hash": e.parent_hash,
            }
            for e in self.executor.scheduler.pool.drain_events()
        ]

    def release_send(self, ask: KvRelease) -> bool:
        """`POST /disagg/release`: whether a context_only request held KV under that id (it
        is released at the executor's next step)."""
        key = ask.disagg_request_id
        if not 0 <= key < 2**63:
            raise bad_request(
                f"disagg_request_id: must be in [0, 2**63), got {key}", param="disagg_request_id"
            )
        if self.executor.transceiver is None:
            raise bad_request(
                "disagg_request_id: there is no KV to release: cache_transceiver is disabled on "
                "this worker",
                param="disagg_request_id",
            )
        return self.executor.release_send(key)

    # ---- requests ----

    def start(self, req: AnyRequest) -> Job:
        if req.model is not None and req.model != self.served_model_name:
            raise ApiError(
                404,
                f"model {req.model!r} not found; this server serves {self.served_model_name!r}",
                param="model",
            )
        params = req.disaggregated_params
        kind = RequestType(params.request_type if params else "context_and_generation")
        if kind is not RequestType.CONTEXT_AND_GENERATION and self.executor.transceiver is None:
            raise bad_request(
                f"disaggregated_params.request_type {kind.value!r} needs the KV cache "
                "transceiver, and cache_transceiver is disabled on this worker",
                param="disaggregated_params",
            )
        prompt_ids = self._prompt_ids(req)
        sampling = self._sampling(req, len(prompt_ids))
        request = Request(
            request_id=next(self._ids),
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            request_type=kind,
            arrival_time=time.monotonic(),
        )
        source, key = None, None
        if kind is RequestType.GENERATION_ONLY:
            assert params is not None
            source = _generation_source(params, self.tokenizer.vocab_size)
        elif kind is RequestType.CONTEXT_ONLY:
            assert params is not None
            key = params.disagg_request_id or (secrets.randbits(62) | 1 << 40)
        transfer_key = source.key if source is not None else key
        if transfer_key is not None and self.executor.transfer_key_in_use(
            transfer_key, sending=source is None
        ):
            raise ApiError(
                409,
                f"disaggregated_params.disagg_request_id: {transfer_key} is already in use by "
                "another request on this worker",
                param="disaggregated_params",
            )
        try:
            handle = self.executor.submit(request, source=source, transfer_key=key)
        except CapacityError as exc:
            raise bad_request(f"prompt: {exc}", param="prompt") from None
        except WorkerStopped as exc:
            raise ApiError(503, str(exc)) from None
        chat = isinstance(req, ChatCompletionRequest)
        meta = responses.ResponseMeta(
            response_id=("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12),
            created=int(time.time()),
            model=self.served_model_name,
            chat=chat,
            return_token_ids=req.return_token_ids,
        )
        return Job(service=self, req=req, handle=handle, meta=meta, transfer_key=key)

    def _prompt_ids(self, req: AnyRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
        elif isinstance(req, CompletionRequest):
            prompt = single_prompt(req)
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        else:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages or []]
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=req.add_generation_prompt
                )
            except Exception as exc:  # a template's raise_exception() names the problem
                raise bad_request(f"messages: {exc}", param="messages") from None
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise bad_request("prompt: must not be empty", param="prompt")
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(
                f"prompt: token id {bad} outside the vocabulary [0, {vocab})", param="prompt"
            )
        if len(ids) >= self.max_seq_len:
            raise bad_request(
                f"prompt: {len(ids)} tokens; this model's context is {self.max_seq_len} tokens",
                param="prompt",
            )
        return ids

    def _sampling(self, req: AnyRequest, prompt_len: int) -> SamplingParams:
        room = self.max_seq_len - prompt_len
        if isinstance(req, ChatCompletionRequest):
            asked = req.max_completion_tokens or req.max_tokens
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            asked = req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
            logprobs = req.logprobs
        stop = req.stop
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
        try:
            return self._sampling_params(req, asked, room, logprobs, stops, top_k)
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    def _sampling_params(
        self,
        req: AnyRequest,
        asked: int | None,
        room: int,
        logprobs: int | None,
        stops: tuple[str, ...],
        top_k: int,
    ) -> SamplingParams:
        return SamplingParams(
            max_tokens=min(asked or room, room),
            temperature=_temperature(req.temperature),
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k,
            seed=req.seed,
            stop=tuple(s for s in stops if s),
            stop_token_ids=frozenset(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            min_tokens=req.min_tokens,
        )

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)


def _temperature(asked: float | None) -> float:
    """The client's temperature; a tiny positive one is greedy (see `MIN_TEMPERATURE`)."""
    if asked is None:
        return 1.0
    return 0.0 if asked < MIN_TEMPERATURE else asked


def _generation_source(params: DisaggregatedParams, vocab_size: int) -> GenerationSource:
    """Validate what a generation_only request must carry from ctx's answer."""
    field = "disaggregated_params"
    first: int | None = None
    if params.first_gen_tokens:
        first = params.first_gen_tokens[0]
        if not 0 <= first < vocab_size:
            raise bad_request(f"{field}.first_gen_tokens: token {first} outside the vocabulary")
    elif params.schedule_style != "generation_first":
        raise bad_request(
            f"{field}.first_gen_tokens: required for generation_only (unless "
            f"{field}.schedule_style is generation_first: then ctx sends it with the KV)",
            param=field,
        )
    if not params.ctx_info_endpoint:
        raise bad_request(f"{field}.ctx_info_endpoint: required for generation_only", param=field)
    if not is_tcp_endpoint(params.ctx_info_endpoint):
        endpoint = params.ctx_info_endpoint
        raise bad_request(
            f"{field}.ctx_info_endpoint: expected tcp://host:port, got {endpoint!r}", param=field
        )
    key = params.disagg_request_id
    if key is None or not 0 < key < 2**63:
        raise bad_request(f"{field}.disagg_request_id: required, in (0, 2**63)", param=field)
    return GenerationSource(
        key=key,
        ctx_info_endpoint=params.ctx_info_endpoint,
        first_token=first,
        ctx_instance=ctx_instance_of(params.opaque_state),
    )


@attrs.define(eq=False, kw_only=True)
class Job:
    service: WorkerService
    req: AnyRequest
    handle: RequestHandle
    meta: responses.ResponseMeta
    transfer_key: int | None = None
    _done: bool = attrs.field(default=False, alias="done")

    @property
    def req_logprobs(self) -> bool:
        return self.handle.request.sampling.logprobs is not None

    @property
    def request_id(self) -> int:
        return self.handle.request.request_id

    def _usage(self, last: RequestOutput) -> Usage:
        return Usage.of(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)

    def _perf(self, last: RequestOutput) -> PerfMetrics | None:
        return last.perf if self.req.return_perf_metrics else None

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        try:
            async with self.handle.outputs:
                async for output in self.handle.outputs:
                    if output.finish_reason is not None:
                        self._done = True
                    yield output
        finally:
            if not self._done:
                self.service.executor.abort(self.request_id)

    async def collect(self) -> dict[str, Any]:
        text: list[str] = []
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        last: RequestOutput | None = None
        async for output in self._outputs():
            text.append(output.text)
            tokens.extend(output.token_ids)
            logprobs.extend(output.logprobs)
            last = output
        assert last is not None
        if last.error is not None:
            # A generation_only request fails when its KV cannot come from ctx: upstream's fault,
            # unless this worker failed it itself (a model step raised).
            gen = self.handle.request.request_type is RequestType.GENERATION_ONLY
            raise ApiError(502 if gen and not last.internal else 500, last.error)
        if last.context_done:
            return self._context_body(text, tokens, logprobs, last)
        assert last.finish_reason is not None
        return responses.whole_body(
            self.meta,
            text="".join(text),
            token_ids=tokens,
            logprobs=self._logprobs(tokens, logprobs),
            finish_reason=last.finish_reason.value,
            usage=self._usage(last),
            prompt_token_ids=self.handle.request.prompt_token_ids
            if self.req.return_token_ids
            else None,
            perf=self._perf(last),
        )

    def _context_body(
        self,
        text: list[str],
        tokens: list[int],
        logprobs: list[TokenLogprobs | None],
        last: RequestOutput,
    ) -> dict[str, Any]:
        """ctx's answer to context_only: the first token plus what gen needs to continue."""
        request = self.handle.request
        instance = self.service.ctx_instance
        params = {
            "request_type": "context_only",
            "first_gen_tokens": tokens[:1],
            "ctx_request_id": request.request_id,
            "disagg_request_id": self.transfer_key,
            "ctx_dp_rank": 0,
            "ctx_info_endpoint": self.service.ctx_info_endpoint,
            "opaque_state": ctx_state(instance) if instance else None,
        }
        return responses.whole_body(
            self.meta,
            text="".join(text),
            token_ids=tokens,
            logprobs=self._logprobs(tokens, logprobs),
            finish_reason=None,
            usage=self._usage(last),
            prompt_token_ids=request.prompt_token_ids,
            extra_choice={"disaggregated_params": params},
            perf=self._perf(last),
        )

    def _logprobs(
        self, tokens: list[int], logprobs: list[TokenLogprobs | None]
    ) -> dict[str, Any] | None:
        build = responses.chat_logprobs if self.meta.chat else responses.completion_logprobs
        return build(tokens, logprobs, self.service.token_text)

    async def stream(self) -> AsyncIterator[bytes]:
        meta = self.meta
        first = True
        if meta.chat:
            yield sse_event(
                responses.chunk_body(
                    meta, text="", token_ids=(), logprobs=None, finish_reason=None, role=True
                )
            )
            first = False
        extra: dict[str, Any] | None = None
        if self.req.return_token_ids:
            extra = {"prompt_token_ids": self.handle.request.prompt_token_ids}
        last: RequestOutput | None = None
        async for output in self._outputs():
            last = output
            reason = output.finish_reason.value if output.finish_reason else None
            carries_tokens = bool(output.token_ids) and (meta.return_token_ids or self.req_logprobs)
            if not output.text and not carries_tokens and reason is None:
                continue  # a token that completes no character yet: nothing to show
            if output.error is not None:
                yield sse_event(ApiError(500, output.error).to_json())
                break
            yield sse_event(
                responses.chunk_body(
                    meta,
                    text=output.text,
                    token_ids=output.token_ids,
                    logprobs=self._logprobs(list(output.token_ids), list(output.logprobs)),
                    finish_reason=reason,
                    role=first and meta.chat,
                    extra=extra if first else None,
                )
            )
            first = False
        options = self.req.stream_options
        if last is not None and options is not None and options.include_usage:
            yield sse_event(responses.usage_chunk(meta, self._usage(last), self._perf(last)))
        yield SSE_DONE
