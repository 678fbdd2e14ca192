"""The offline engine (`from trtdisagg import LLM, SamplingParams`) against a worker process over
HTTP with the same config: the same greedy tokens, text and finish reasons, for prompts given
as text and as token ids, several at once, and for chat conversations against the chat route
(tiny model, CPU). The worker is the session's shared ctx worker: the default config, plus a
transceiver that aggregated requests leave unused."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import httpx
import pytest

from tests.edges import Cluster
from tests.procs import Server, worker_config

if TYPE_CHECKING:  # (the offline engine imports torch: at first use, not at collection)
    from trtdisagg import LLM

PROMPTS: list[str | list[int]] = [
    "The quick brown fox",
    [(7 * i + 3) % 500 + 1 for i in range(40)],
    "a",
    [(11 * i + 5) % 500 + 1 for i in range(150)],  # prefilled in chunks next to decodes
]
MAX_TOKENS = [12, 20, 5, 9]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Name a colour"},
        {"role": "assistant", "content": "Blue"},
        {"role": "user", "content": [{"type": "text", "text": "Another"}]},  # as content parts
    ],
]


@pytest.fixture(scope="module")
def worker(shared_cluster: tuple[Cluster, httpx.Client]) -> Server:
    return shared_cluster[0].ctx


@pytest.fixture(scope="module")
def llm() -> LLM:
    from trtdisagg import LLM

    config = worker_config()
    return LLM(config.pop("model"), **config)


def http_tokens(
    url: str, prompt: str | list[int], max_tokens: int, *, stream: bool, **extra: Any
) -> Any:
    body = {
        **extra,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    with httpx.Client(timeout=60) as client:
        if not stream:
            r = client.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["token_ids"], choice["text"], choice["finish_reason"]
        tokens: list[int] = []
        text, reason = "", None
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        tokens.extend(choice.get("token_ids", []))
                        text += choice.get("text", "")
                        reason = choice.get("finish_reason") or reason
        return tokens, text, reason


def test_offline_greedy_tokens_equal_the_workers(worker: Server, llm: LLM, tmp_path: Path) -> None:
    from trtdisagg import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(PROMPTS, params)
    assert [o.prompt for o in outputs] == [p if isinstance(p, str) else None for p in PROMPTS]
    for i, (prompt, n, out) in enumerate(zip(PROMPTS, MAX_TOKENS, outputs, strict=True)):
        assert len(out.token_ids) == n and out.finish_reason == "length"
        for stream in (False, True):
            tokens, text, reason = http_tokens(worker.url, prompt, n, stream=stream)
            assert list(out.token_ids) == tokens, (i, stream)
            assert (out.text, out.finish_reason) == (text, reason), (i, stream)
        assert out.perf is not None and out.perf.first_token_s > 0
    # A second call on the same engine, one prompt as token ids, logprobs asked for.
    (again,) = llm.generate(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0, logprobs=1))
    assert again.token_ids == outputs[1].token_ids[:4]
    assert again.logprobs is not None and all(lp is not None for lp in again.logprobs)
    # vLLM's text controls: the stop string kept, special tokens' text kept
    text = outputs[0].text
    stop = next(text[i : i + 2] for i in range(3, 9) if "\ufffd" not in text[i : i + 2])
    end = text.find(stop)
    ask = {"max_tokens": MAX_TOKENS[0], "temperature": 0.0, "stop": [stop]}
    (cut,) = llm.generate(PROMPTS[0], SamplingParams(**ask))
    (kept,) = llm.generate(PROMPTS[0], SamplingParams(**ask, include_stop_str_in_output=True))
    assert (cut.text, kept.text) == (text[:end], text[: end + len(stop)])
    assert cut.finish_reason == kept.finish_reason == "stop"
    special = {"max_tokens": 2, "temperature": 0.0, "logit_bias": {5: 100.0}}  # <|assistant|>
    (kept,) = llm.generate(PROMPTS[0], SamplingParams(**special, skip_special_tokens=False))
    assert kept.text == "<|assistant|>" * 2


def test_vllm_prompt_and_token_controls_act_as_on_the_worker(worker: Server, llm: LLM) -> None:
    """vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens: the same tokens as the
    worker's HTTP route; a token outside the logits is refused, naming the field."""
    from trtdisagg import SamplingParams

    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    free = llm.generate(PROMPTS[0], greedy)[0].token_ids
    controls = {
        "allowed_token_ids": sorted({free[2], free[5], 7}),
        "bad_words": [llm.tokenizer.decode(free[:2])],
        "truncate_prompt_tokens": 2,
    }
    for name, value in controls.items():
        (out,) = llm.generate(PROMPTS[0], attrs.evolve(greedy, **{name: value}))
        assert out.token_ids != free
        tokens, _, _ = http_tokens(worker.url, PROMPTS[0], 8, stream=False, **{name: value})
        assert list(out.token_ids) == tokens, name
    with pytest.raises(ValueError, match="allowed_token_ids or bad_words"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, allowed_token_ids=[10**6]))


def test_chat_prompts_and_greedy_replies_equal_the_chat_route_s(worker: Server, llm: LLM) -> None:
    from transformers import AutoTokenizer

    from trtdisagg import SamplingParams
    from trtdisagg.model.loader import resolve_model

    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = llm.chat(CONVERSATIONS, params)
    assert len(outputs) == len(CONVERSATIONS)
    with httpx.Client(timeout=60) as client:
        for i, (messages, out) in enumerate(zip(CONVERSATIONS, outputs, strict=True)):
            body = {"messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}  # fmt: skip
            r = client.post(worker.url + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            answer = r.json()
            choice = answer["choices"][0]
            assert list(out.prompt_token_ids) == answer["prompt_token_ids"], i
            assert list(out.token_ids) == choice["token_ids"], i
            assert out.text == choice["message"]["content"], i
            assert out.finish_reason == choice["finish_reason"] == "length"
    # The prompt is the model's chat template, rendered as transformers renders it.
    hf = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    expected = hf.apply_chat_template(
        CONVERSATIONS[0], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert list(outputs[0].prompt_token_ids) == list(expected)
    assert outputs[0].prompt == hf.apply_chat_template(
        CONVERSATIONS[0], add_generation_prompt=True, tokenize=False
    )
    # One conversation alone (a list of messages) is one output, the same reply.
    (alone,) = llm.chat(CONVERSATIONS[1], params)
    assert alone.token_ids == outputs[1].token_ids
    # Tools reach the template as the route gives them to it.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    (with_tools,) = llm.chat(CONVERSATIONS[0], params, tools=tools)
    assert with_tools.prompt is not None and "get_weather" in with_tools.prompt
    body = {"messages": CONVERSATIONS[0], "tools": tools, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    r = httpx.post(worker.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert list(with_tools.prompt_token_ids) == r.json()["prompt_token_ids"]
    # vLLM's continue_final_message: the prompt ends inside the assistant's message, as
    # transformers renders it; with add_generation_prompt as well, a ValueError naming it.
    going = [*CONVERSATIONS[0], {"role": "assistant", "content": "Well,"}]
    (more,) = llm.chat(going, params, add_generation_prompt=False, continue_final_message=True)
    assert more.prompt == hf.apply_chat_template(
        going, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    with pytest.raises(ValueError, match=r"conversations\[0\]\.continue_final_message"):
        llm.chat(going, params, continue_final_message=True)
    with pytest.raises(ValueError, match=r"conversations\[0\]\.chat_template_kwargs"):
        llm.chat(going, params, chat_template_kwargs={"tools": []})


def test_n_seeded_samples_equal_the_route_s_choices(worker: Server, llm: LLM) -> None:
    from trtdisagg import SamplingParams

    prompts = ["The quick brown fox", [(5 * i + 2) % 500 + 1 for i in range(30)]]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    outputs = llm.generate(prompts, params, n=3)
    with httpx.Client(timeout=60) as client:
        for prompt, out in zip(prompts, outputs, strict=True):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 3,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            r = client.post(worker.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choices = sorted(r.json()["choices"], key=lambda c: c["index"])
            assert [o.index for o in out.outputs] == [0, 1, 2]
            assert [list(o.token_ids) for o in out.outputs] == [c["token_ids"] for c in choices]
            assert [o.text for o in out.outputs] == [c["text"] for c in choices]
    samples = {o.token_ids for o in outputs[0].outputs}
    assert len(samples) == 3, "three seeds, three different samples"
    (alone,) = llm.generate(prompts[0], params)  # sample 0 is the answer with n=1
    assert alone.outputs == outputs[0].outputs[:1]
    (chat,) = llm.chat(CONVERSATIONS[0], params, n=2)
    assert [o.index for o in chat.outputs] == [0, 1]


def test_prompt_logprobs_equal_the_route_s_echoed_ones(worker: Server, llm: LLM) -> None:
    from trtdisagg import SamplingParams

    prompt = [(13 * i + 4) % 500 + 1 for i in range(24)]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2, logprobs=2)
    (out,) = llm.generate(prompt, params)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None  # nothing comes before the first token
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2}
    r = httpx.post(worker.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    echoed = r.json()["choices"][0]["logprobs"]["token_logprobs"][: len(prompt)]
    assert echoed[0] is None
    ours = [lp.logprob for lp in out.prompt_logprobs[1:] if lp is not None]
    assert ours == pytest.approx(echoed[1:], abs=1e-5)
    for token, lp in zip(prompt[1:], out.prompt_logprobs[1:], strict=True):
        assert lp is not None and len(lp.top) == 2 and lp.logprob <= lp.top[0][1] + 1e-6
        if token in dict(lp.top):  # the prompt's token among the top: the same logprob
            assert dict(lp.top)[token] == pytest.approx(lp.logprob, abs=1e-6)
    (plain,) = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))
    assert plain.prompt_logprobs is None and plain.token_ids == out.token_ids


@pytest.mark.parametrize(
    "constraint",
    [
        {"choice": ["yes", "no", "maybe"]},
        {"regex": "[0-9]{3}-[a-z]{2}"},
        {
            "json": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            }
        },
    ],
    ids=["choice", "regex", "json"],
)
def test_structured_outputs_follow_the_constraint_as_the_route_s(
    worker: Server, llm: LLM, constraint: dict[str, Any]
) -> None:
    from trtdisagg import SamplingParams

    prompts = ["Answer:", [(3 * i + 1) % 500 + 1 for i in range(20)]]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outputs = llm.generate(prompts, params, structured_outputs=constraint)
    with httpx.Client(timeout=60) as client:
        for prompt, out in zip(prompts, outputs, strict=True):
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0,
                    "structured_outputs": constraint, "return_token_ids": True}  # fmt: skip
            r = client.post(worker.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert (list(out.token_ids), out.text) == (choice["token_ids"], choice["text"])
            assert out.finish_reason == choice["finish_reason"] == "stop", out.text
            if "choice" in constraint:
                assert out.text in constraint["choice"]
            elif "regex" in constraint:
                assert re.fullmatch(constraint["regex"], out.text)
            else:
                assert isinstance(json.loads(out.text)["ok"], bool)
    (chat,) = llm.chat(CONVERSATIONS[0], params, structured_outputs=constraint)
    assert chat.finish_reason == "stop"


def test_an_interrupted_call_leaves_the_engine_idle_and_reusable(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trio

    from trtdisagg import SamplingParams
    from trtdisagg.worker.engine.executor import Executor, RequestHandle
    from trtdisagg.worker.engine.loop import StepLoop

    prompt = [(7 * i + 3) % 500 + 1 for i in range(16)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (before,) = llm.generate(prompt, greedy)
    run_until_idle = StepLoop.run_until_idle
    live_at_interrupt: list[int] = []

    async def interrupted_once(loop: StepLoop, *args: Any) -> None:
        if live_at_interrupt:  # later calls
            return await run_until_idle(loop, *args)
        async with trio.open_nursery() as nursery:  # Ctrl-C once every request is under way
            nursery.start_soon(run_until_idle, loop, *args)
            for handle in handles:
                received = 0
                while received < 8:
                    received += len((await handle.outputs.receive()).token_ids)
            nursery.cancel_scope.cancel()
        live_at_interrupt.append(llm.executor.num_active())
        # as a real Ctrl-C comes out of the step loop: from inside its nurseries
        raise BaseExceptionGroup("Exceptions from Trio nursery", [KeyboardInterrupt()])

    handles: list[RequestHandle] = []
    submit_group = Executor.submit_group

    def recording(executor: Executor, *args: Any, **kwargs: Any) -> list[RequestHandle]:
        handles.extend(submit_group(executor, *args, **kwargs))
        return handles[-len(args[0]) :]

    monkeypatch.setattr(Executor, "submit_group", recording)
    monkeypatch.setattr(StepLoop, "run_until_idle", interrupted_once)
    long = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):  # itself, as `except KeyboardInterrupt` expects
        llm.generate([prompt] * 4, long)
    assert live_at_interrupt == [4]  # interrupted mid-way: every request still running
    assert llm.executor.num_active() == 0  # nothing left to run
    assert llm.executor.scheduler.pool.statistics().used_blocks == 0
    (after,) = llm.generate(prompt, greedy)
    assert after.token_ids == before.token_ids


def test_bad_prompts_are_refused_before_anything_runs() -> None:
    from trtdisagg import LLM, SamplingParams

    config = worker_config(max_seq_len=64)
    llm = LLM(config.pop("model"), **config)
    with pytest.raises(ValueError, match=r"prompts\[1\]: token id 100000 outside"):
        llm.generate([[1, 2], [100000]])
    with pytest.raises(ValueError, match=r"prompts\[0\]: 60 prompt tokens \+ max_tokens 8"):
        llm.generate([[1] * 60], SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="2 given for 1 prompts"):
        llm.generate("x", [SamplingParams(max_tokens=1)] * 2)
    with pytest.raises(ValueError, match="n: must be at least 1, got 0"):
        llm.generate("x", n=0)
    with pytest.raises(ValueError, match="structured_outputs: expected exactly one of"):
        llm.generate("x", structured_outputs={"json": {}, "regex": "a"})
    with pytest.raises(ValueError, match="structured_outputs: "):
        llm.generate("x", structured_outputs={"regex": "("})  # llguidance refuses it
    user = {"role": "user", "content": "x"}
    with pytest.raises(ValueError, match=r"conversations\[1\]\.messages\[0\]\.role"):
        llm.chat([[user], [{"content": "x"}]])
    with pytest.raises(ValueError, match="messages: must not be empty"):
        llm.chat([])
    with pytest.raises(ValueError, match=r"conversations\[0\]\.messages: must not be empty"):
        llm.chat([[]])
    with pytest.raises(ValueError, match=r"conversations\[0\]\.tools\[0\]"):
        llm.chat([user], tools=[{"type": "function"}])  # no function
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    with pytest.raises(ValueError, match=r"conversations\[0\]\.messages\[0\]\.content\[1\]\.type"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}])
    with pytest.raises(ValueError, match="messages and conversations mixed"):
        llm.chat([user, [user]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"conversations\[0\]: \d+ prompt tokens \+ max_tokens"):
        llm.chat([{"role": "user", "content": "y" * 60}], SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM("tiny", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_batch_sise"):
        LLM("tiny", max_batch_sise=4)
    absent = max(os.sched_getaffinity(0)) + 1  # refused before this process is pinned
    with pytest.raises(ValueError, match=f"cpu_affinity: CPU {absent} not available"):
        LLM("tiny", cpu_affinity=[absent])
    assert llm.executor.num_active() == 0
