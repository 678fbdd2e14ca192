"""WorkerService: turns a validated OpenAI request into executor requests, one per choice.

It owns what the HTTP routes need besides parsing: tokenising the prompts or chat, the model-name,
context-length and vocabulary checks, request ids, and the choices' submission; `jobs.Job` reads
their outputs into whole or streamed bodies. A handler that goes away (client disconnect,
cancellation) aborts its requests, which frees their blocks at the executor's next step.
"""

from __future__ import annotations

import itertools
import secrets
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trtdisagg.api.chat import ChatRender
from trtdisagg.api.errors import ApiError, bad_request
from trtdisagg.api.fanout import ChoicePlan, plan_choices
from trtdisagg.api.grammars import output_grammar
from trtdisagg.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    KvRelease,
)
from trtdisagg.api.tool_calls import ToolCallFormat, parses_tool_calls, tool_call_format
from trtdisagg.api.validation import is_batched, kept_prompt, logit_bias_of, num_candidates
from trtdisagg.config import WorkerConfig
from trtdisagg.errors import CapacityError, WorkerStopped
from trtdisagg.ids import new_transfer_key
from trtdisagg.kv.hashing import HASH_ALGORITHM, salt_root
from trtdisagg.worker.engine.live import GenerationSource
from trtdisagg.worker.grammar import GrammarCompiler, GrammarError, GrammarTemplate
from trtdisagg.worker.http import responses
from trtdisagg.worker.http.engine import Engine
from trtdisagg.worker.http.gen_source import generation_source
from trtdisagg.worker.http.jobs import ChoiceRun, CtxEndpoint, Job
from trtdisagg.worker.request import MIN_TEMPERATURE, Request, RequestType, SamplingParams
from trtdisagg.worker.token_bans import bad_word_ids
from trtdisagg.worker.tokenization import Tokenizer

if TYPE_CHECKING:
    from trtdisagg.faults.spec import FaultInjector

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
    engine: Engine  # in this process (`LocalEngine`) or behind a link (`front/`)
    max_seq_len: int
    ready: bool = False
    started_at: float = attrs.field(factory=time.time)
    # New at each start of the worker (its fronts share it): a coordinator that sees another
    # value in /health knows the worker restarted between two checks, with whatever new
    # settings and an empty cache.
    boot_id: str = attrs.field(factory=lambda: secrets.token_hex(8))
    ctx_info_endpoint: str | None = None
    ctx_instance: str | None = None  # this worker's transceiver instance name (handoff.py)
    faults: FaultInjector | None = None  # tests only: armed by TRTDISAGG_FAULTS
    grammars: GrammarCompiler | None = None  # made by the first request with a grammar
    # The chat template's tool-call format (api/tool_calls.py), if it has one this server knows.
    tool_format: ToolCallFormat | None = attrs.field(
        default=attrs.Factory(
            lambda self: tool_call_format(self.tokenizer.chat_template), takes_self=True
        )
    )
    _ids: itertools.count[int] = attrs.field(factory=itertools.count, alias="ids")

    def _compiler(self) -> GrammarCompiler:
        return GrammarCompiler(
            tokenizer_json=self.tokenizer.to_json(),
            vocab_size=self.engine.vocab_size,
            eos_token_ids=sorted(self.tokenizer.eos_token_ids),
        )

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
            kv_compat=self.engine.kv_compat,
        )

    @property
    def has_transceiver(self) -> bool:
        return self.engine.kv_compat is not None

    async def render_metrics(self) -> bytes:
        return await self.engine.render_metrics()

    async def drain_kv_events(self, after: int | None = None) -> list[dict[str, Any]]:
        return await self.engine.drain_kv_events(after)

    async def release_send(self, ask: KvRelease) -> bool:
        """`POST /disagg/release`: whether a context_only request held, or will hold, KV under
        that transfer key (it is released at the executor's next step, or when its prefill
        ends)."""
        key = ask.key
        if key is None or not 0 <= key < 2**64:
            raise bad_request(f"transfer_key: required, in [0, 2**64), got {key}",
                              param="transfer_key")  # fmt: skip
        if not self.has_transceiver:
            raise bad_request(
                "disagg_request_id: there is no KV to release: cache_transceiver is disabled on "
                "this worker",
                param="disagg_request_id",
            )
        return await self.engine.release_send(key)

    # ---- requests ----

    async def start(self, req: AnyRequest) -> Job:
        """Submit every choice of a validated request (`api/fanout.py`); the job reads them.
        A grammar the request asks for is compiled first, in a worker thread."""
        if req.model is not None and req.model != self.served_model_name:
            raise ApiError(
                404,
                f"model {req.model!r} not found; this server serves {self.served_model_name!r}",
                param="model",
            )
        params = req.disaggregated_params
        kind = RequestType(params.request_type if params else "context_and_generation")
        if kind is not RequestType.CONTEXT_AND_GENERATION and not self.has_transceiver:
            raise bad_request(
                f"disaggregated_params.request_type {kind.value!r} needs the KV cache "
                "transceiver, and cache_transceiver is disabled on this worker",
                param="disaggregated_params",
            )
        grammar = await self._grammar(req)
        plans = plan_choices(req)
        prompts = self._prompts(req, plans)
        sampling = {p: self._sampling(req, len(ids)) for p, ids in prompts.items()}
        source, key, disagg_id = None, None, None
        if kind is RequestType.GENERATION_ONLY:
            assert params is not None
            candidates = num_candidates(req)
            source = generation_source(params, self.tokenizer.vocab_size, candidates, prompts[0])
        elif kind is RequestType.CONTEXT_ONLY:
            assert params is not None
            disagg_id = params.disagg_request_id or (secrets.randbits(62) | 1 << 40)
            key = params.transfer_key or params.disagg_request_id or new_transfer_key()
        transfer_key = source.key if source is not None else key
        if transfer_key is not None and await self.engine.transfer_key_in_use(
            transfer_key, sending=source is None
        ):
            raise ApiError(
                409,
                f"disaggregated_params.transfer_key: {transfer_key} is already in use by "
                "another request on this worker",
                param="disaggregated_params",
            )
        runs = self._submit_choices(
            req, plans, prompts, sampling, kind=kind, source=source, key=key, grammar=grammar
        )
        chat = isinstance(req, ChatCompletionRequest)
        meta = responses.ResponseMeta(
            response_id=("chatcmpl-" if chat else "cmpl-")
            + (req.request_id or secrets.token_hex(12)),
            created=int(time.time()),
            model=self.served_model_name,
            chat=chat,
            return_token_ids=req.return_token_ids,
        )
        return Job(
            req=req,
            runs=runs,
            meta=meta,
            text_of=_token_id_text if req.return_tokens_as_token_ids else self.token_text,
            ctx=CtxEndpoint(info_endpoint=self.ctx_info_endpoint, instance=self.ctx_instance),
            transfer_key=key,
            disagg_request_id=disagg_id,
            single_prompt=len(prompts) == 1,
            keep=req.n if num_candidates(req) > req.n else None,
            tools=(
                self.tool_format
                if isinstance(req, ChatCompletionRequest) and parses_tool_calls(req)
                else None
            ),
            # an answer held to a grammar is the answer alone: none of it is thinking
            reasoning=self.tokenizer.think_tokens if chat and grammar is None else None,
        )

    async def _grammar(self, req: AnyRequest) -> GrammarTemplate | None:
        """The output grammar `req` asks for, compiled (or from the compiler's cache).

        Raises:
            ApiError: a malformed constraint, or one llguidance refuses (400 naming its field).
        """
        wanted = output_grammar(req, self.tool_format)
        if wanted is None:
            return None
        compiler = self.grammars
        if compiler is None:  # made on first use: it reads the whole vocabulary
            compiler = self.grammars = await trio.to_thread.run_sync(self._compiler)
        if compiler.cached(wanted):  # no thread hop for a schema seen before
            template = compiler.compile(wanted)
        else:
            try:
                template = await trio.to_thread.run_sync(compiler.compile, wanted)
            except GrammarError as exc:
                raise bad_request(f"{wanted.field}: {exc}", param=wanted.field) from None
        return template

    def _submit_choices(
        self,
        req: AnyRequest,
        plans: list[ChoicePlan],
        prompts: dict[int, list[int]],
        sampling: dict[int, SamplingParams],
        *,
        kind: RequestType,
        source: GenerationSource | None,
        key: int | None,
        grammar: GrammarTemplate | None,
    ) -> list[ChoiceRun]:
        """One executor request per choice, a prompt's `n` choices submitted together: one
        prefill (or KV transfer) serves them, and they fork at their first tokens. All or none
        are queued."""
        echo = isinstance(req, CompletionRequest) and req.echo
        scoring = echo and req.max_tokens == 0  # the prompt alone is answered
        chat_echo = _chat_echo(req)
        by_prompt: dict[int, list[ChoicePlan]] = {}
        for plan in plans:
            by_prompt.setdefault(plan.prompt_index, []).append(plan)
        runs: list[ChoiceRun] = []
        try:
            for index, group in by_prompt.items():
                choices = [
                    Request(
                        request_id=next(self._ids),
                        prompt_token_ids=list(prompts[index]),
                        sampling=attrs.evolve(sampling[index], seed=plan.seed),
                        request_type=kind,
                        arrival_time=time.monotonic(),
                        root=salt_root(req.cache_salt),
                    )
                    for plan in group
                ]
                handles = self.engine.submit_group(
                    choices, source=source, transfer_key=key, grammar=grammar
                )
                for plan, handle in zip(group, handles, strict=True):
                    runs.append(
                        ChoiceRun(
                            plan=plan,
                            handle=handle,
                            engine=self.engine,
                            echo=self._echo(req, plan, prompts) if echo else chat_echo,
                            interval=max(self.config.stream_interval, req.stream_interval or 1),
                            scoring=scoring,
                        )
                    )
        except (CapacityError, WorkerStopped) as exc:
            for run in runs:
                run.drop()
            if isinstance(exc, WorkerStopped):
                raise ApiError(503, str(exc)) from None
            raise bad_request(f"prompt: {exc}", param="prompt") from None
        return runs

    def _prompts(self, req: AnyRequest, plans: list[ChoicePlan]) -> dict[int, list[int]]:
        """Each prompt's token ids, tokenized once however many choices it has."""
        prompts: dict[int, list[int]] = {}
        batched = isinstance(req, CompletionRequest) and is_batched(req)
        for plan in plans:
            if plan.prompt_index not in prompts:
                where = f"prompt[{plan.prompt_index}]" if batched else "prompt"
                prompts[plan.prompt_index] = self._prompt_ids(req, plan.prompt, where)
        return prompts

    def _prompt_ids(self, req: AnyRequest, prompt: str | list[int] | None, where: str) -> list[int]:
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
        elif isinstance(req, CompletionRequest):
            assert prompt is not None
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        else:
            ids = self._chat_prompt_ids(req)
        if not ids:
            raise bad_request(f"{where}: must not be empty", param="prompt")
        keep = req.truncate_prompt_tokens
        if keep is not None:
            if keep > self.max_seq_len:
                raise bad_request(
                    f"truncate_prompt_tokens: {keep} is more than this model's context of "
                    f"{self.max_seq_len} tokens",
                    param="truncate_prompt_tokens",
                )
            ids = kept_prompt(ids, keep, self.max_seq_len, req.truncation_side)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(
                f"{where}: token id {bad} outside the vocabulary [0, {vocab})", param="prompt"
            )
        if len(ids) >= self.max_seq_len:
            raise bad_request(
                f"{where}: {len(ids)} tokens; this model's context is {self.max_seq_len} tokens",
                param="prompt",
            )
        return ids

    def _chat_prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        try:
            _, ids = self.tokenizer.chat_prompt(ChatRender.of(req))
        except Exception as exc:  # a template's raise_exception() names the problem
            raise bad_request(f"messages: {exc}", param="messages") from None
        return ids

    def _echo(self, req: AnyRequest, plan: ChoicePlan, prompts: dict[int, list[int]]) -> str:
        """The prompt text `echo` prepends: the client's string, or the tokens the model read
        (its token ids, or what is left of a string after `truncate_prompt_tokens`) decoded."""
        if isinstance(plan.prompt, str) and req.truncate_prompt_tokens is None:
            return plan.prompt
        return self.tokenizer.decode(prompts[plan.prompt_index], skip_special_tokens=False)

    def _sampling(self, req: AnyRequest, prompt_len: int) -> SamplingParams:
        room = self.max_seq_len - prompt_len
        field = "max_tokens"
        prompt_logprobs = req.prompt_logprobs  # vLLM's; or echo's (below), whichever is more
        if isinstance(req, ChatCompletionRequest):
            if req.max_completion_tokens is not None:
                field = "max_completion_tokens"
            asked = req.max_completion_tokens or req.max_tokens
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            max_tokens = room if asked is None else asked
        else:
            asked = req.max_tokens
            logprobs = req.logprobs
            max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, room) if asked is None else asked
            max_tokens = max_tokens or 1  # echo's scoring: the token sampled is not answered
            if req.echo and logprobs is not None:  # the echoed prompt's, computed by prefill
                prompt_logprobs = max(logprobs, prompt_logprobs or 0)
            if num_candidates(req) > req.n and logprobs is None:
                logprobs = 0  # best_of ranks candidates by their tokens' logprobs
        if max_tokens > room:
            raise bad_request(
                f"{field}: the prompt's {prompt_len} tokens + {field} {max_tokens} exceed this "
                f"model's context of {self.max_seq_len} tokens",
                param=field,
            )
        vocab = self.tokenizer.vocab_size
        bad_stop = next((t for t in req.stop_token_ids or () if not 0 <= t < vocab), None)
        if bad_stop is not None:
            raise bad_request(
                f"stop_token_ids: token id {bad_stop} outside the vocabulary [0, {vocab})",
                param="stop_token_ids",
            )
        # The logits' width too: a bias is added to a logit, which must exist.
        logits_width = min(vocab, self.engine.vocab_size)
        bias = logit_bias_of(req)
        bad_bias = next((t for t in sorted(bias) if t >= logits_width), None)
        if bad_bias is not None:
            raise bad_request(
                f"logit_bias: token id {bad_bias} outside the vocabulary [0, {logits_width})",
                param="logit_bias",
            )
        for field in ("allowed_token_ids", "logprob_token_ids"):
            outside = next((t for t in getattr(req, field) or () if t >= logits_width), None)
            if outside is not None:
                raise bad_request(
                    f"{field}: token id {outside} outside the vocabulary [0, {logits_width})",
                    param=field,
                )
        bad_words = tuple(req.bad_words or ())
        bad_ids = bad_word_ids(bad_words, partial(self.tokenizer.encode, add_special_tokens=False))
        outside = next((t for ids in bad_ids for t in ids if t >= logits_width), None)
        if outside is not None:
            raise bad_request(
                f"bad_words: a word spells token {outside}, outside the logits [0, {logits_width})",
                param="bad_words",
            )
        stop = req.stop
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=_temperature(req.temperature),
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=top_k,
                seed=req.seed,
                stop=tuple(s for s in stops if s),
                stop_token_ids=frozenset(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                allowed_token_ids=req.allowed_token_ids,
                logprob_token_ids=req.logprob_token_ids,
                bad_words=bad_words,
                bad_word_ids=bad_ids,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                logprobs=logprobs,
                min_tokens=req.min_tokens,
                min_p=req.min_p or 0.0,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0,
                logit_bias=bias,
                prompt_logprobs=prompt_logprobs,
            )
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)


def _token_id_text(token: int) -> str:
    """A logprobs entry's token under `return_tokens_as_token_ids` (vLLM's): its id, exactly,
    where its text may not decode alone."""
    return f"token_id:{token}"


def _chat_echo(req: AnyRequest) -> str | None:
    """vLLM's chat `echo`: the answer starts with the conversation's last message when that is
    the assistant's (a reply the model goes on with); else None."""
    if not isinstance(req, ChatCompletionRequest) or not req.echo or not req.messages:
        return None
    last = req.messages[-1]
    return last.text() if last.role == "assistant" else None


def _temperature(asked: float | None) -> float:
    """The client's temperature; a tiny positive one is greedy (see `MIN_TEMPERATURE`)."""
    if asked is None:
        return 1.0
    return 0.0 if asked < MIN_TEMPERATURE else asked
