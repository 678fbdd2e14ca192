"""The offline engine: `LLM(model, **worker_config).generate(prompts, sampling_params)`, and
`.chat(conversations, sampling_params)` for chat messages.

The same engine as a worker's (`build_runner`, `assemble_executor`: the scheduler, the step loop,
the runner, the output processor), without HTTP and without a transceiver. `generate` puts every
prompt into the executor's inbox at once and runs the loop until each request is done
(`StepLoop.run_until_idle`) inside a `trio.run` of its own, so it blocks and returns the
requests' outputs in the prompts' order. Keyword arguments are worker config keys (DESIGN.md §4;
`device="cuda"`, `dtype="bfloat16"`, `max_batch_size=...`), checked as a config file's are.
`chat` reads each conversation as the HTTP chat route reads `messages` (the same checks, the
same chat-template rendering), so its prompt tokens equal the route's. `n` (no upper bound
here) and `structured_outputs` work as the routes' fields of those names.

One rank only: tensor- and pipeline-parallel instances serve through `python -m trtdisagg`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import attrs
import trio

from trtdisagg.api.chat import ChatRender
from trtdisagg.api.codec import parse_request
from trtdisagg.api.errors import ApiError
from trtdisagg.api.fanout import choice_seed
from trtdisagg.api.grammars import output_grammar
from trtdisagg.api.protocol import ChatCompletionRequest, CompletionRequest, PerfMetrics
from trtdisagg.api.validation import kept_prompt
from trtdisagg.config import ConfigError, WorkerConfig, structure
from trtdisagg.cpu_affinity import CpuAffinityError, pin_engine
from trtdisagg.errors import CapacityError
from trtdisagg.metrics import WorkerMetrics
from trtdisagg.model.loader import resolve_model
from trtdisagg.model.parallel import Parallel
from trtdisagg.worker.engine.build import assemble_executor
from trtdisagg.worker.engine.executor import Executor, RequestHandle
from trtdisagg.worker.engine.wakeup import Wakeup
from trtdisagg.worker.grammar import GrammarCompiler, GrammarError, GrammarTemplate
from trtdisagg.worker.request import Request, SamplingParams
from trtdisagg.worker.runner import ModelRunner, build_runner
from trtdisagg.worker.token_bans import bad_word_ids
from trtdisagg.worker.token_logprobs import TokenLogprobs
from trtdisagg.worker.tokenization import Tokenizer, TokenizerError

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

Prompt = str | Sequence[int]
Conversation = Sequence[Mapping[str, Any]]  # OpenAI chat messages: {"role": ..., "content": ...}


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
    """One prompt's result: its tokens and its generated sequences (`n` of them, by `index`:
    vLLM's shape), with the first sequence's fields at the top level for convenience."""

    request_id: int
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    perf: PerfMetrics | None = None  # queue, prefill, first token and decode times
    # With `SamplingParams.prompt_logprobs`: one entry per prompt token, each given the tokens
    # before it; the first token has none (None), as in vLLM.
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

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
        self.executor: Executor = self._new_executor()
        self._next_id = 0
        self._grammars: GrammarCompiler | None = None  # made by the first constrained call

    @property
    def max_seq_len(self) -> int:
        return self.executor.max_seq_len

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        n: int = 1,
        structured_outputs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or a list of either) and
        return their outputs in order. `sampling_params` is one for all or one per prompt;
        None is `SamplingParams(max_tokens=16)` (temperature 1). Blocks until all are done.

        `n` samples of each prompt (its output's `outputs`, by `index`) fork from one prefill,
        as the HTTP routes' `n` do; with a `seed`, sample i samples with `choice_seed(seed, i)`
        (`api/fanout.py`), so sample 0 equals the answer with `n=1`.

        `structured_outputs` constrains every output as the routes' field of that name does:
        exactly one of `{"json": schema, "regex": ..., "choice": [...], "grammar": ...}`.

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, a prompt with
                `max_tokens` longer than the model's context, mismatched lengths, `n` < 1, or a
                constraint that is malformed or that llguidance refuses.
        """
        batch = _as_batch(prompts)
        encoded = [self._encode(i, prompt) for i, prompt in enumerate(batch)]
        texts = [prompt if isinstance(prompt, str) else None for prompt in batch]
        grammar = self._grammar(structured_outputs)
        return self._generate("prompts", texts, encoded, sampling_params, n, grammar)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        n: int = 1,
        structured_outputs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to each conversation (one list of messages, or a list of them),
        rendered with the model's chat template as `/v1/chat/completions` renders `messages`
        (with `tools`, OpenAI tool objects, and `chat_template_kwargs` given to the template;
        `continue_final_message` ends the prompt inside the last, assistant, message). Each
        output's `prompt` is the rendered text. `sampling_params`, `n` and
        `structured_outputs` as for `generate`.

        Raises:
            ValueError: a malformed message or tool (named as `conversations[i].messages[j]`),
                no chat template, or any reason `generate` gives.
        """
        conversations = _as_conversations(messages)
        controls: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "chat_template_kwargs": chat_template_kwargs,
            "tools": tools,
        }
        prompts = [self._render(i, c, controls) for i, c in enumerate(conversations)]
        for i, (_, ids) in enumerate(prompts):
            self._check_ids(f"conversations[{i}]", ids)
        grammar = self._grammar(structured_outputs)
        texts = [text for text, _ in prompts]
        encoded = [ids for _, ids in prompts]
        return self._generate("conversations", texts, encoded, sampling_params, n, grammar)

    def _generate(
        self,
        what: str,
        texts: Sequence[str | None],
        encoded: Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        n: int,
        grammar: GrammarTemplate | None,
    ) -> list[RequestOutput]:
        """Run `n` requests per prompt (`what`: how errors name the prompts)."""
        if n < 1:
            raise ValueError(f"n: must be at least 1, got {n}")
        params = _params_for(what, len(encoded), sampling_params)
        groups = [
            self._group(f"{what}[{i}]", ids, sp, n)
            for i, (ids, sp) in enumerate(zip(encoded, params, strict=True))
        ]
        try:
            return trio.run(self._run, texts, groups, grammar)
        except BaseException as exc:
            # A call that raised (Ctrl-C, say) may have left the step loop mid-round: requests
            # half ended, blocks held for a step whose end was never taken. The next call gets
            # a fresh engine on the same model and KV cache instead of inheriting them.
            self.executor = self._new_executor()
            if isinstance(exc, BaseExceptionGroup):  # Ctrl-C inside the loop's nurseries
                interrupt, rest = exc.split(KeyboardInterrupt)
                if interrupt is not None and rest is None:
                    raise KeyboardInterrupt from None  # what `except KeyboardInterrupt` catches
            raise

    def _new_executor(self) -> Executor:
        return assemble_executor(
            self.config,
            runner=self.runner,
            tokenizer=self.tokenizer,
            metrics=WorkerMetrics.create(),
            wakeup=Wakeup(),
        )

    async def _run(
        self,
        texts: Sequence[str | None],
        groups: Sequence[list[Request]],
        grammar: GrammarTemplate | None,
    ) -> list[RequestOutput]:
        handles = [self.executor.submit_group(group, grammar=grammar) for group in groups]
        await self.executor.loop.run_until_idle()
        return [self._collect(text, group) for text, group in zip(texts, handles, strict=True)]

    def _grammar(self, structured_outputs: Mapping[str, Any] | None) -> GrammarTemplate | None:
        """`structured_outputs` checked as the routes check it, compiled (llguidance)."""
        if structured_outputs is None:
            return None
        try:
            wanted = output_grammar(
                CompletionRequest(structured_outputs=dict(structured_outputs)), None
            )
        except ApiError as exc:
            raise ValueError(exc.message) from None
        assert wanted is not None  # (a structured_outputs given is one grammar or a 400)
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                tokenizer_json=self.tokenizer.to_json(),
                vocab_size=self.executor.vocab_size,
                eos_token_ids=sorted(self.tokenizer.eos_token_ids),
            )
        try:
            return self._grammars.compile(wanted)
        except GrammarError as exc:
            raise ValueError(f"{wanted.field}: {exc}") from None

    def _render(
        self, index: int, conversation: Conversation, controls: Mapping[str, Any]
    ) -> tuple[str, list[int]]:
        """One conversation as the chat route reads, renders and encodes it (`controls`: the
        chat request's other fields)."""
        where = f"conversations[{index}]"
        body = {"messages": conversation, **{k: v for k, v in controls.items() if v is not None}}
        try:
            req = parse_request(body, ChatCompletionRequest)
        except ApiError as exc:
            raise ValueError(f"{where}.{exc.message}") from None
        try:
            return self.tokenizer.chat_prompt(ChatRender.of(req))
        except TokenizerError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def _encode(self, index: int, prompt: Prompt) -> list[int]:
        where = f"prompts[{index}]"
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._check_ids(where, ids)
        return ids

    def _check_ids(self, where: str, ids: Sequence[int]) -> None:
        if not ids:
            raise ValueError(f"{where}: must not be empty")
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{where}: token id {bad} outside the vocabulary [0, {vocab})")

    def _group(self, where: str, ids: list[int], params: SamplingParams, n: int) -> list[Request]:
        """One prompt's `n` requests (one per sample), checked to fit."""
        keep = params.truncate_prompt_tokens
        if keep is not None and keep > self.max_seq_len:
            raise ValueError(
                f"{where}: truncate_prompt_tokens {keep} is more than the model's context of "
                f"{self.max_seq_len} tokens"
            )
        ids = kept_prompt(ids, keep, self.max_seq_len)
        if len(ids) + params.max_tokens > self.max_seq_len:
            raise ValueError(
                f"{where}: {len(ids)} prompt tokens + max_tokens {params.max_tokens} exceed "
                f"the model's context of {self.max_seq_len} tokens"
            )
        params = self._with_bans(where, params)
        group = []
        for i in range(n):
            self._next_id += 1
            seed = None if params.seed is None else choice_seed(params.seed, i)
            group.append(
                Request(
                    request_id=self._next_id,
                    prompt_token_ids=ids,
                    sampling=attrs.evolve(params, seed=seed),
                    arrival_time=time.monotonic(),
                )
            )
        try:
            self.executor.check_fits(group[0])
        except CapacityError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return group

    def _with_bans(self, where: str, params: SamplingParams) -> SamplingParams:
        """`params` with its bad words' token sequences (`token_bans.bad_word_ids`), each of
        those and its allowed tokens checked against the logits."""
        width = self.executor.vocab_size
        words = bad_word_ids(
            params.bad_words, partial(self.tokenizer.encode, add_special_tokens=False)
        )
        outside = [t for t in params.allowed_token_ids or () if t >= width]
        outside += [t for ids in words for t in ids if t >= width]
        if outside:
            raise ValueError(
                f"{where}: token id {min(outside)} of allowed_token_ids or bad_words outside "
                f"the logits [0, {width})"
            )
        return attrs.evolve(params, bad_word_ids=words) if words else params

    def _collect(self, text: str | None, handles: Sequence[RequestHandle]) -> RequestOutput:
        """One prompt's output: its samples' tokens, and the first sample's timings."""
        samples = [_sample(i, h) for i, h in enumerate(handles)]
        leader = handles[0].request
        prompt_logprobs = samples[0].prompt_logprobs
        return RequestOutput(
            request_id=leader.request_id,
            prompt=text,
            prompt_token_ids=tuple(leader.prompt_token_ids),
            outputs=tuple(sample.completion for sample in samples),
            perf=samples[0].perf,
            prompt_logprobs=None if prompt_logprobs is None else (None, *prompt_logprobs),
        )


@attrs.frozen(kw_only=True)
class _Sample:
    completion: CompletionOutput
    perf: PerfMetrics | None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None  # from the prompt's second token on


def _sample(index: int, handle: RequestHandle) -> _Sample:
    """A finished request's sequence, timings and prompt logprobs, from its channel."""
    tokens: list[int] = []
    texts: list[str] = []
    logprobs: list[TokenLogprobs | None] = []
    reason = None
    perf = None
    prompt_logprobs = None
    while True:
        try:
            out = handle.outputs.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            break
        tokens.extend(out.token_ids)
        texts.append(out.text)
        logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            prompt_logprobs = out.prompt_logprobs
        if out.finish_reason is not None:
            reason = out.finish_reason.value
            perf = out.perf
        if out.error is not None:
            raise RuntimeError(f"request {handle.request.request_id} failed: {out.error}")
    wants = handle.request.sampling.logprobs is not None
    completion = CompletionOutput(
        index=index,
        text="".join(texts),
        token_ids=tuple(tokens),
        logprobs=tuple(logprobs) if wants else None,
        finish_reason=reason,
    )
    return _Sample(completion=completion, perf=perf, prompt_logprobs=prompt_logprobs)


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


def _as_conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation (a list of message mappings) or a list of them, as a list of them."""
    if isinstance(messages, str | bytes | Mapping):
        raise ValueError("messages: a list of messages, or a list of such lists")
    listed = list(messages)
    if not listed:
        raise ValueError("messages: must not be empty")
    if all(isinstance(item, Mapping) for item in listed):
        return [listed]  # type: ignore[list-item]  # (one conversation, its messages)
    if any(isinstance(item, Mapping) for item in listed):
        raise ValueError("messages: messages and conversations mixed in one list")
    return listed  # type: ignore[return-value]


def _params_for(
    what: str, count: int, params: SamplingParams | Sequence[SamplingParams] | None
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams(max_tokens=16)] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    listed = list(params)
    if len(listed) != count:
        raise ValueError(
            f"sampling_params: {len(listed)} given for {count} {what} (give one, or one each)"
        )
    return listed
