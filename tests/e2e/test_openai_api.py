"""The OpenAI API as real clients use it, against real processes (`tests/openai_cluster.py`: a ctx
and a gen worker behind a coordinator, on `tiny`, shared with the other modules that only send it
requests), the worker alone and the coordinator. Each feature is checked for OpenAI's shape (the
official `openai` client parses every answer) and for agreement: the same tokens split or not,
greedy and seeded at temperature 1. The validation list is `test_openai_validation.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.edges import Cluster, wait_idle, wait_until
from tests.openai_cluster import (
    CHAT,
    IDS,
    LOGPROB_TOLERANCE,
    PROMPTS,
    TARGETS,
    TOOL_TURNS,
    TOOLS,
    api,
    assert_stream_shape,
    both,
    by_choice,
    generation_first_coordinator,
    sse,
    tokens_of,
    url_of,
)
from tests.procs import Server, metric
from trtdisagg.api.fanout import choice_seed
from trtdisagg.worker.tokenization import Tokenizer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(shared_cluster: tuple[Cluster, httpx.Client]) -> Cluster:
    return shared_cluster[0]


@pytest.fixture(scope="module")
def http(shared_cluster: tuple[Cluster, httpx.Client]) -> httpx.Client:
    return shared_cluster[1]


@pytest.fixture(scope="module")
def generation_first(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """A second coordinator over the same workers, with schedule_style: generation_first."""
    tmp = tmp_path_factory.mktemp("generation_first")
    with generation_first_coordinator(cluster, tmp) as server:
        yield server


# ---- models ----


@pytest.mark.parametrize("target", TARGETS)
def test_models(cluster: Cluster, target: str) -> None:
    client = api(url_of(cluster, target))
    [model] = client.models.list().data
    assert model.id == "tiny" and model.object == "model" and model.created > 0
    assert model.max_model_len == 4096
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["param"] == "model" and "gpt-4" in info.value.body["message"]


# ---- batched prompts and n ----


def test_batched_prompts_and_n_agree_split_or_not(cluster: Cluster) -> None:
    worker, coordinator = both(cluster)
    ask = {
        "model": "tiny",
        "prompt": PROMPTS,
        "n": 2,
        "max_tokens": 5,
        "temperature": 0,
        "extra_body": {**IDS, "ignore_eos": True},
    }
    alone, split = worker.completions.create(**ask), coordinator.completions.create(**ask)
    for answer in (alone, split):
        assert [c.index for c in answer.choices] == list(range(6))
        prompt_ids = [c.prompt_token_ids for c in answer.choices]
        assert prompt_ids[0] == prompt_ids[1] != prompt_ids[2] == prompt_ids[3]
        assert answer.usage is not None
        assert answer.usage.prompt_tokens == sum(len(ids) for ids in prompt_ids[::2])
        assert answer.usage.completion_tokens == 6 * 5
    assert tokens_of(alone) == tokens_of(split)
    assert [c.text for c in alone.choices] == [c.text for c in split.choices]
    for p, prompt in enumerate(PROMPTS):  # a batch equals its prompts sent one by one
        one = worker.completions.create(**{**ask, "prompt": prompt, "n": 1})
        assert tokens_of(one)[0] == tokens_of(alone)[2 * p] == tokens_of(alone)[2 * p + 1]


def test_seeded_choices_agree_split_or_not_and_reproduce(cluster: Cluster) -> None:
    worker, coordinator = both(cluster)
    ask = {
        "model": "tiny",
        "prompt": PROMPTS[:2],
        "n": 3,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 1234,
        "extra_body": {**IDS, "ignore_eos": True},
    }
    alone, split = worker.completions.create(**ask), coordinator.completions.create(**ask)
    assert tokens_of(alone) == tokens_of(split)
    assert len({tuple(t) for t in tokens_of(alone)[:3]}) > 1  # the choices really sample
    for i in range(3):  # choice i samples with choice_seed(seed, i), as docs/API.md says
        one = worker.completions.create(
            **{**ask, "prompt": PROMPTS[1], "n": 1, "seed": choice_seed(1234, i)}
        )
        assert tokens_of(one)[0] == tokens_of(alone)[3 + i]


@pytest.mark.parametrize("seed", [None, 77])
def test_chat_n_streams_interleave_and_agree(
    cluster: Cluster, http: httpx.Client, seed: int | None
) -> None:
    body = {
        "messages": CHAT,
        "n": 3,
        "max_tokens": 6,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **IDS,
        **({"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}),
    }
    streamed: dict[str, dict[int, list[int]]] = {}
    for target in TARGETS:
        events = sse(http, url_of(cluster, target) + "/v1/chat/completions", body)
        usage = assert_stream_shape(events, 3)
        assert usage["completion_tokens"] == 18
        choices = by_choice(events)
        for chunks in choices.values():
            assert chunks[0]["delta"].get("role") == "assistant"
            assert all("role" not in c["delta"] for c in chunks[1:])
        streamed[target] = {i: [t for c in cs for t in c["token_ids"]] for i, cs in choices.items()}
        whole = api(url_of(cluster, target)).chat.completions.create(
            model="tiny", messages=CHAT, n=3, max_tokens=6, seed=seed,
            temperature=0 if seed is None else 1.0, extra_body={**IDS, "ignore_eos": True},
        )  # fmt: skip
        assert [list(c.token_ids) for c in whole.choices] == [streamed[target][i] for i in range(3)]
    assert streamed["worker"] == streamed["coordinator"]


@pytest.mark.parametrize("target", TARGETS)
def test_completion_stream_with_n_and_batch(
    cluster: Cluster, http: httpx.Client, target: str
) -> None:
    body = {
        "prompt": PROMPTS[:2],
        "n": 2,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **IDS,
    }
    events = sse(http, url_of(cluster, target) + "/v1/completions", body)
    usage = assert_stream_shape(events, 4)
    whole = api(url_of(cluster, target)).completions.create(
        model="tiny", prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=0,
        extra_body={**IDS, "ignore_eos": True},
    )  # fmt: skip
    assert whole.usage is not None and usage == whole.usage.model_dump(exclude_none=True)
    texts = {i: "".join(c["text"] for c in cs) for i, cs in by_choice(events).items()}
    assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]


def test_best_of_equal_to_n(cluster: Cluster) -> None:
    for client in both(cluster):
        answer = client.completions.create(
            model="tiny", prompt="Hi", n=2, best_of=2, max_tokens=2, temperature=0
        )
        assert len(answer.choices) == 2


# ---- logprobs ----


def _close(a: list[float | None], b: list[float | None]) -> bool:
    return len(a) == len(b) and all(
        x is not None and y is not None and abs(x - y) < LOGPROB_TOLERANCE
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completion_logprobs_are_whole_through_the_split(
    cluster: Cluster, temperature: float
) -> None:
    worker, coordinator = both(cluster)
    ask = {
        "model": "tiny",
        "prompt": PROMPTS[1],
        "max_tokens": 6,
        "logprobs": 3,
        "seed": 5,
        "temperature": temperature,
        "extra_body": {**IDS, "ignore_eos": True},
    }
    alone, split = worker.completions.create(**ask), coordinator.completions.create(**ask)
    assert tokens_of(alone) == tokens_of(split)
    a, s = alone.choices[0].logprobs, split.choices[0].logprobs
    assert a is not None and s is not None
    assert s.token_logprobs is not None and s.token_logprobs[0] is not None  # ctx's token
    assert _close(list(a.token_logprobs or []), list(s.token_logprobs))
    assert s.tokens == a.tokens and s.text_offset == a.text_offset
    assert s.top_logprobs is not None and a.top_logprobs is not None
    for top_a, top_s, token in zip(a.top_logprobs, s.top_logprobs, s.tokens or [], strict=True):
        # 3 best plus the sampled token, fewer when tokens share a text (a dict by text)
        assert set(top_a) == set(top_s) and token in top_s and len(top_s) <= 4


@pytest.mark.parametrize("target", TARGETS)
def test_logprob_token_ids_score_the_named_tokens_at_every_token(
    cluster: Cluster, target: str
) -> None:
    """vLLM's `logprob_token_ids`: each token's alternatives are the named tokens' logprobs,
    in their order (the sampled token's own is kept beside them in completions), through the
    split too; the same values as a plain top-k request finds for those tokens."""
    client = api(url_of(cluster, target))
    ask: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4,
                           "temperature": 0}  # fmt: skip
    by_id = {"return_tokens_as_token_ids": True}
    plain = client.completions.create(**ask, logprobs=5, extra_body=by_id)
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.top_logprobs
    first = plain.choices[0].logprobs.top_logprobs[0]
    ids = [int(key.split(":")[1]) for key in first][:4][::-1]  # not the top-k's order
    named = client.completions.create(
        **ask, logprobs=0, extra_body={**by_id, "logprob_token_ids": ids}
    )
    got = named.choices[0].logprobs
    assert got is not None and got.top_logprobs is not None and got.tokens is not None
    assert got.tokens == plain.choices[0].logprobs.tokens  # the same greedy tokens
    for token, entry in zip(got.tokens, got.top_logprobs, strict=True):
        assert set(entry) == {f"token_id:{i}" for i in ids} | {token}
    for i in ids:
        assert abs(got.top_logprobs[0][f"token_id:{i}"] - first[f"token_id:{i}"]) < 1e-4
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
        extra_body={**by_id, "logprob_token_ids": ids},
    )  # fmt: skip
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    for entry in chat.choices[0].logprobs.content:
        assert [alt.token for alt in entry.top_logprobs] == [f"token_id:{i}" for i in ids]


def test_return_tokens_as_token_ids_names_every_logprob_token_by_id(cluster: Cluster) -> None:
    """vLLM's `return_tokens_as_token_ids`: completions' tokens and top keys, chat's tokens,
    streamed or not, worker and split (ctx's first token included) alike."""
    as_ids = {**IDS, "return_tokens_as_token_ids": True}
    for client in both(cluster):
        answer = client.completions.create(
            model="tiny", prompt=PROMPTS[1], max_tokens=5, logprobs=2, extra_body=as_ids
        )
        logprobs = answer.choices[0].logprobs
        assert logprobs is not None and logprobs.top_logprobs is not None
        ids = answer.choices[0].token_ids  # type: ignore[attr-defined]
        assert logprobs.tokens == [f"token_id:{t}" for t in ids]
        assert all(key.startswith("token_id:") for top in logprobs.top_logprobs for key in top)
        stream = client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=2,
            extra_body=as_ids, stream=True,
        )  # fmt: skip
        entries, ids = [], []
        for chunk in stream:
            for choice in chunk.choices:
                ids += choice.token_ids or []  # type: ignore[attr-defined]
                entries += choice.logprobs.content or [] if choice.logprobs else []
        assert [e.token for e in entries] == [f"token_id:{t}" for t in ids]
        assert all(t.token.startswith("token_id:") for e in entries for t in e.top_logprobs)


def test_a_request_id_names_the_answer(cluster: Cluster) -> None:
    """vLLM's `request_id`: the answer's id is `cmpl-`/`chatcmpl-` and it, every chunk of a
    stream too, worker and split alike."""
    for client in both(cluster):
        ask: dict[str, Any] = {"model": "tiny", "max_tokens": 3}
        whole = client.completions.create(prompt="Hi", extra_body={"request_id": "job-7"}, **ask)
        assert whole.id == "cmpl-job-7"
        stream = client.chat.completions.create(
            messages=CHAT, extra_body={"request_id": "job-8"}, stream=True, **ask
        )
        assert {chunk.id for chunk in stream} == {"chatcmpl-job-8"}


def test_logprobs_0_give_the_sampled_token_alone(cluster: Cluster) -> None:
    for client in both(cluster):
        answer = client.completions.create(
            model="tiny", prompt="Hi", max_tokens=3, logprobs=0, temperature=0
        )
        lp = answer.choices[0].logprobs
        assert lp is not None and lp.tokens and lp.top_logprobs and lp.token_logprobs
        assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_have_one_entry_per_token_through_the_split(
    cluster: Cluster, http: httpx.Client, stream: bool
) -> None:
    body = {
        "messages": CHAT,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
        **IDS,
    }
    entries: dict[str, list[dict[str, Any]]] = {}
    for target in TARGETS:
        url = url_of(cluster, target) + "/v1/chat/completions"
        if stream:
            events = sse(http, url, {**body, "stream": True})
            chunks = by_choice(events)[0]
            with_tokens = [c for c in chunks if c["token_ids"]]
            assert all(c["logprobs"] is not None for c in with_tokens)  # the first one too
            entries[target] = [e for c in with_tokens for e in c["logprobs"]["content"]]
        else:
            answer = api(url_of(cluster, target)).chat.completions.create(
                model="tiny", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                top_logprobs=2, extra_body={**IDS, "ignore_eos": True},
            )  # fmt: skip
            content = answer.choices[0].logprobs.content
            entries[target] = [e.model_dump() for e in content or []]
        assert len(entries[target]) == 5
    alone, split = entries["worker"], entries["coordinator"]
    assert [e["token"] for e in alone] == [e["token"] for e in split]
    assert _close([e["logprob"] for e in alone], [e["logprob"] for e in split])
    assert all(len(e["top_logprobs"]) == 2 for e in split)


def test_generation_first_serves_logprobs_context_first(
    cluster: Cluster, generation_first: Server
) -> None:
    worker, coordinator = api(cluster.ctx.url), api(generation_first.url)
    ask = {
        "model": "tiny",
        "prompt": PROMPTS[0],
        "max_tokens": 6,
        "logprobs": 2,
        "temperature": 0,
        "extra_body": {**IDS, "ignore_eos": True},
    }
    alone, split = worker.completions.create(**ask), coordinator.completions.create(**ask)
    assert tokens_of(alone) == tokens_of(split)
    lp = split.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and None not in lp.token_logprobs
    seeded = {**ask, "temperature": 1.0, "seed": 99}  # seeded, without logprobs: gen first
    del seeded["logprobs"]
    assert tokens_of(worker.completions.create(**seeded)) == tokens_of(
        coordinator.completions.create(**seeded)
    )


# ---- echo ----


@pytest.mark.parametrize("target", TARGETS)
def test_echo(cluster: Cluster, http: httpx.Client, target: str) -> None:
    client = api(url_of(cluster, target))
    plain = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=4, temperature=0)
    echoed = client.completions.create(
        model="tiny", prompt=PROMPTS[:2], max_tokens=4, temperature=0, echo=True
    )
    for prompt, a, b in zip(PROMPTS, plain.choices, echoed.choices, strict=False):
        assert b.text == prompt + a.text
    prompt_ids = client.completions.create(
        model="tiny", prompt="Hi!", max_tokens=1, extra_body=IDS
    ).prompt_token_ids
    ids = client.completions.create(
        model="tiny", prompt=[prompt_ids], max_tokens=2, temperature=0, echo=True
    )
    assert ids.choices[0].text.startswith("<|bos|>Hi!")  # token ids: decoded as they are
    events = sse(
        http,
        url_of(cluster, target) + "/v1/completions",
        {"prompt": PROMPTS[:2], "max_tokens": 4, "temperature": 0, "echo": True, "stream": True},
    )
    for index, chunks in by_choice(events).items():
        assert chunks[0]["text"] == PROMPTS[index]
        assert "".join(c["text"] for c in chunks) == echoed.choices[index].text


@pytest.mark.parametrize("target", TARGETS)
def test_chat_echo_starts_the_reply_with_the_assistant_s_last_message(
    cluster: Cluster, http: httpx.Client, target: str
) -> None:
    """vLLM's chat `echo`: with the assistant's message last (continued), the reply's content
    starts with it, whole and streamed; with the user's last, it changes nothing."""
    client = api(url_of(cluster, target))
    going = [*CHAT, {"role": "assistant", "content": "Two plus two is"}]
    ask: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    goes_on = {"continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(messages=going, extra_body=goes_on, **ask)
    echoed = client.chat.completions.create(
        messages=going, extra_body={**goes_on, "echo": True}, **ask
    )
    reply = plain.choices[0].message.content or ""
    assert echoed.choices[0].message.content == "Two plus two is" + reply
    assert echoed.usage is not None and plain.usage is not None
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens  # the echo is not
    body = {"messages": going, **goes_on, "echo": True, "stream": True, **ask}
    chunks = by_choice(sse(http, url_of(cluster, target) + "/v1/chat/completions", body))[0]
    assert chunks[0]["delta"]["content"] == "Two plus two is"
    streamed = "".join(c["delta"].get("content") or "" for c in chunks)
    assert streamed == echoed.choices[0].message.content
    asked = client.chat.completions.create(messages=CHAT, extra_body={"echo": True}, **ask)
    alone = client.chat.completions.create(messages=CHAT, **ask)
    assert asked.choices[0].message.content == alone.choices[0].message.content


# ---- usage in every chunk ----


@pytest.mark.parametrize("target", TARGETS)
def test_continuous_usage_stats(cluster: Cluster, http: httpx.Client, target: str) -> None:
    body = {
        "prompt": PROMPTS[:2],
        "n": 2,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = sse(http, url_of(cluster, target) + "/v1/completions", body)
    chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
    assert chunks and all("usage" in e for e in chunks)
    seen: dict[int, int] = {}
    for event in chunks:
        index, used = event["choices"][0]["index"], event["usage"]["completion_tokens"]
        assert used >= seen.get(index, 0)
        seen[index] = used
    assert seen == {i: 5 for i in range(4)}
    assert assert_stream_shape(events, 4)["completion_tokens"] == 20


# ---- tools ----


def _template_ids(http: httpx.Client, cluster: Cluster, tools: Any, messages: Any) -> list[int]:
    info = http.get(cluster.ctx.url + "/server_info").json()
    tokenizer = Tokenizer.from_dir(Path(info["model_path"]))
    text = tokenizer.apply_chat_template(messages, tools=tools)
    return tokenizer.encode(text, add_special_tokens=False)


def test_tools_and_tool_turns_reach_the_chat_template(cluster: Cluster, http: httpx.Client) -> None:
    rendered = [
        {k: v if v is not None else "" for k, v in m.items()} for m in TOOL_TURNS
    ]  # the worker renders a null content as ""
    expected = _template_ids(http, cluster, TOOLS, rendered)
    without = _template_ids(http, cluster, None, rendered)
    assert expected != without
    results = []
    for client in both(cluster):
        for choice, ids in (("auto", expected), ("none", without)):
            answer = client.chat.completions.create(
                model="tiny", messages=TOOL_TURNS, tools=TOOLS, tool_choice=choice,
                max_tokens=3, temperature=0, extra_body=IDS,
            )  # fmt: skip
            assert answer.prompt_token_ids == ids
            results.append(list(answer.choices[0].token_ids))
    assert results[:2] == results[2:]  # split or not


def test_chat_rendering_controls_shape_the_prompt(cluster: Cluster, http: httpx.Client) -> None:
    """vLLM's `continue_final_message` (the prompt ends inside the assistant's message, whose
    reply goes on from it, the same tokens as a completion of that prompt), `add_special_tokens`
    (the tokenizer's BOS before the template's) and `chat_template_kwargs` (accepted; `tiny`'s
    template reads none), split or not."""
    info = http.get(cluster.ctx.url + "/server_info").json()
    tokenizer = Tokenizer.from_dir(Path(info["model_path"]))
    messages = [*CHAT, {"role": "assistant", "content": "Two plus two is"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    continued = tokenizer.encode(rendered[: rendered.rindex(" is") + 3], add_special_tokens=False)
    plain = tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    goes_on = {**IDS, "continue_final_message": True, "add_generation_prompt": False}
    with_bos = {**IDS, "add_special_tokens": True, "chat_template_kwargs": {"enable_thinking": 0}}
    results = []
    for client in both(cluster):
        ask: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "temperature": 0}
        answer = client.chat.completions.create(messages=messages, extra_body=goes_on, **ask)
        assert answer.prompt_token_ids == continued  # type: ignore[attr-defined]
        results.append(list(answer.choices[0].token_ids))  # type: ignore[attr-defined]
        same = client.completions.create(prompt=continued, extra_body=IDS, **ask)
        assert tokens_of(same)[0] == results[-1]
        answer = client.chat.completions.create(messages=CHAT, extra_body=with_bos, **ask)
        assert answer.prompt_token_ids == [tokenizer.bos_token_id, *plain]  # type: ignore[attr-defined]
    assert results[0] == results[1]


def test_truncate_prompt_tokens_keeps_the_prompt_s_end(cluster: Cluster) -> None:
    """vLLM's `truncate_prompt_tokens`: the model reads the prompt's last k tokens (the same
    tokens as a completion of just those), chat and completions, split or not; `echo` gives
    the text it read."""
    worker, _ = both(cluster)
    ask: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    whole = worker.completions.create(prompt=PROMPTS[1], extra_body=IDS, **ask)
    ids = whole.prompt_token_ids  # type: ignore[attr-defined]
    chat = worker.chat.completions.create(messages=CHAT, extra_body=IDS, **ask)
    chat_ids = chat.prompt_token_ids  # type: ignore[attr-defined]
    short = {**IDS, "truncate_prompt_tokens": 3}
    results = []
    for client in both(cluster):
        cut = client.completions.create(prompt=PROMPTS[1], extra_body=short, **ask)
        assert cut.prompt_token_ids == ids[-3:]  # type: ignore[attr-defined]
        same = client.completions.create(prompt=ids[-3:], extra_body=IDS, **ask)
        assert tokens_of(cut) == tokens_of(same)
        echoed = client.completions.create(prompt=PROMPTS[1], echo=True, extra_body=short, **ask)
        read = client.completions.create(prompt=ids[-3:], echo=True, **ask)
        assert echoed.choices[0].text == read.choices[0].text
        answer = client.chat.completions.create(messages=CHAT, extra_body=short, **ask)
        assert answer.prompt_token_ids == chat_ids[-3:]  # type: ignore[attr-defined]
        results.append((tokens_of(cut), list(answer.choices[0].token_ids)))  # type: ignore[attr-defined]
        right = {**short, "truncation_side": "right"}  # vLLM's: the first k instead
        cut = client.completions.create(prompt=PROMPTS[1], extra_body=right, **ask)
        assert cut.prompt_token_ids == ids[:3]  # type: ignore[attr-defined]
        answer = client.chat.completions.create(messages=CHAT, extra_body=right, **ask)
        assert answer.prompt_token_ids == chat_ids[:3]  # type: ignore[attr-defined]
    assert results[0] == results[1]


@pytest.mark.parametrize("target", TARGETS)
def test_stream_interval_gathers_tokens_into_chunks(
    cluster: Cluster, http: httpx.Client, target: str
) -> None:
    """vLLM's per-request `stream_interval`: after the first, each chunk carries at least that
    many tokens (the last may carry fewer); the text is the same."""
    body = {"prompt": PROMPTS[0], "max_tokens": 11, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}  # fmt: skip
    url = url_of(cluster, target) + "/v1/completions"
    one = by_choice(sse(http, url, body))[0]
    four = by_choice(sse(http, url, {**body, "stream_interval": 4}))[0]
    sizes = [len(c["token_ids"]) for c in four if c["token_ids"]]
    assert sum(sizes) == 11 and all(size >= 4 for size in sizes[1:-1]), sizes
    assert len(sizes) <= 4 < len([c for c in one if c["token_ids"]])
    assert "".join(c["text"] for c in four) == "".join(c["text"] for c in one)


# ---- /v1/responses ----


def test_responses_agree_split_or_not(cluster: Cluster) -> None:
    answers = [
        client.responses.create(
            model="tiny",
            instructions="Be brief.",
            max_output_tokens=6,
            input=[{"role": "user", "content": "Hello there"}],
            temperature=0,
        )
        for client in both(cluster)
    ]
    for answer in answers:
        assert answer.object == "response" and answer.status in ("completed", "incomplete")
        assert answer.output[0].type == "message"
        assert answer.usage is not None and 1 <= answer.usage.output_tokens <= 6
        assert answer.usage.total_tokens == answer.usage.input_tokens + answer.usage.output_tokens
    assert answers[0].output_text == answers[1].output_text
    assert answers[0].usage.input_tokens == answers[1].usage.input_tokens


@pytest.mark.parametrize("target", TARGETS)
def test_responses_stream(cluster: Cluster, target: str) -> None:
    client = api(url_of(cluster, target))
    whole = client.responses.create(
        model="tiny", input="Once upon a time", max_output_tokens=5, temperature=0
    )
    events = list(
        client.responses.create(
            model="tiny", input="Once upon a time", max_output_tokens=5, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_responses_logprobs_are_chat_s_whole_and_streamed(cluster: Cluster) -> None:
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: the text part holds
    each output token's logprob and alternatives, the chat route's for the same request; a
    stream's deltas carry them too, and its done event all of them; split or not."""
    ask: dict[str, Any] = {"model": "tiny", "input": "Once upon a time", "max_output_tokens": 5,
                           "temperature": 0, "include": ["message.output_text.logprobs"],
                           "top_logprobs": 2}  # fmt: skip
    chat = both(cluster)[0].chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    wanted = [(e.token, len(e.top_logprobs)) for e in chat.choices[0].logprobs.content]
    for client in both(cluster):
        whole = client.responses.create(**ask)
        part = whole.output[0].content[0]  # type: ignore[union-attr]
        assert [(e.token, len(e.top_logprobs)) for e in part.logprobs] == wanted
        events = list(client.responses.create(**ask, stream=True))
        streamed = [e for ev in events if ev.type == "response.output_text.delta"
                    for e in ev.logprobs]  # fmt: skip
        assert [e.token for e in streamed] == [token for token, _ in wanted]
        done = next(e for e in events if e.type == "response.output_text.done")
        assert [e.token for e in done.logprobs] == [token for token, _ in wanted]
    plain = both(cluster)[0].responses.create(**{**ask, "include": []})
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]


@pytest.mark.parametrize("target", TARGETS)
def test_responses_refuse_what_they_do_not_support(cluster: Cluster, target: str) -> None:
    client = api(url_of(cluster, target))
    for field, value in (
        ("store", True),
        ("previous_response_id", "resp_1"),
        ("tools", [{"type": "web_search"}]),  # a hosted tool (function tools are served)
        ("reasoning", {"effort": "low"}),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="tiny", input="x", **{field: value})
        assert info.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="x", max_output_tokens=5000)
    assert info.value.body["param"] == "max_output_tokens"


# ---- clients that leave ----


@pytest.mark.parametrize("target", TARGETS)
def test_leaving_a_stream_of_several_choices_frees_everything(
    cluster: Cluster, http: httpx.Client, target: str
) -> None:
    url = url_of(cluster, target)
    aborted = 'role="coordinator",status="aborted"'

    def counts() -> tuple[float, float]:
        text = http.get(url + "/metrics").text
        return metric(text, "trtdisagg_requests_total", aborted), metric(
            text, "trtdisagg_requests_running"
        )

    before = counts()[0]
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    stream = http.stream("POST", url + "/v1/completions", json=body)
    with stream as r, contextlib.suppress(httpx.HTTPError):
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the choices are running: hang up
    for worker in cluster.workers:
        wait_idle(http, worker, timeout=30)
    if target == "coordinator":  # the client's request is counted once, however many choices
        wait_until(lambda: counts() == (before + 1, 0), 10, "the request counted as aborted")


# ---- /tokenize and /detokenize ----


@pytest.mark.parametrize("target", TARGETS)
def test_tokenize_counts_what_the_generation_routes_prefill(
    cluster: Cluster, http: httpx.Client, target: str
) -> None:
    """vLLM's routes: a prompt's and a conversation's tokens are those a completion and a chat
    request of the same fields prefill (the coordinator asks a worker); detokenize gives the
    text back; a bad body is a 400 naming its field, another model a 404."""
    url = url_of(cluster, target)
    answer = http.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 1,
                                                      **IDS}).json()  # fmt: skip
    r = http.post(url + "/tokenize", json={"model": "tiny", "prompt": PROMPTS[0],
                                           "return_token_strs": True})  # fmt: skip
    assert r.status_code == 200, r.text
    told = r.json()
    assert told["tokens"] == answer["prompt_token_ids"]
    assert told["count"] == answer["usage"]["prompt_tokens"] and told["max_model_len"] == 4096
    assert len(told["token_strs"]) == told["count"] and all(told["token_strs"])
    going = [*CHAT, {"role": "assistant", "content": "It is"}]
    controls = {"add_generation_prompt": False, "continue_final_message": True}
    chat = http.post(url + "/v1/chat/completions", json={"messages": going, "max_tokens": 1,
                                                         **controls, **IDS}).json()  # fmt: skip
    r = http.post(url + "/tokenize", json={"messages": going, **controls})
    assert r.json()["tokens"] == chat["prompt_token_ids"] and r.json()["token_strs"] is None
    r = http.post(url + "/detokenize", json={"tokens": told["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"].endswith(PROMPTS[0]), r.text
    for path, body, field in (
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
        ("/detokenize", {"tokens": [1, 512]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ):
        r = http.post(url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, body, r.text)
    r = http.post(url + "/tokenize", json={"model": "other", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


# ---- cache_salt ----


@pytest.mark.parametrize("target", TARGETS)
def test_cache_salt_shares_cached_prompts_only_under_the_same_salt(
    cluster: Cluster, http: httpx.Client, target: str
) -> None:
    """vLLM's cache_salt: a prompt served before is a prefix-cache hit again unsalted, and
    under a salt only for that salt, split or not (the ctx worker's count, as usage reports)."""
    prompt = f"{target}: " + " ".join(f"salted word {i}" for i in range(60))

    def cached(salt: str | None) -> int:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        r = http.post(url_of(cluster, target) + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached(None) == 0 and cached(None) > 0
    assert cached("tenant-a") == 0 and cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    assert cached(None) > 0 and cached("tenant-a") > 0
