"""A prompt's `n` choices share its prefill and its KV transfer, through real processes
(`tests/openai_cluster.py`: a ctx and a gen worker behind a coordinator, on `tiny`, shared with the
other modules that only send it requests): the workers' counters prove one prefill and one transfer;
the choices agree split or not, greedy and seeded; `best_of` keeps the best candidates; `echo` with
`logprobs`, and vLLM's `prompt_logprobs`, give the prompt's logprobs, computed by the prefill on
ctx when split, and `max_tokens: 0` with `echo` scores the prompt alone.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.edges import Cluster, metrics_of, wait_until
from tests.openai_cluster import (
    CHAT,
    IDS,
    LOGPROB_TOLERANCE,
    PROMPTS,
    TARGETS,
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
from trtdisagg.kv.cache import KVCache

pytestmark = pytest.mark.timeout(300)

PROMPT_LEN = 1000


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
    tmp = tmp_path_factory.mktemp("fork_generation_first")
    with generation_first_coordinator(cluster, tmp) as server:
        yield server


def block_bytes(http: httpx.Client, cluster: Cluster) -> int:
    """One KV block of `tiny` in the workers' pools (float32, 16 tokens)."""
    info = http.get(cluster.ctx.url + "/server_info").json()
    config = json.loads((Path(info["model_path"]) / "config.json").read_text())
    heads = config["num_attention_heads"]
    return KVCache.bytes_per_block(
        num_layers=config["num_hidden_layers"],
        num_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim", config["hidden_size"] // heads),
        tokens_per_block=info["tokens_per_block"],
        dtype=torch.float32,
    )


COUNTERS = {
    "prefill": "trtdisagg_prefill_tokens_total",
    "prompt": "trtdisagg_prompt_tokens_total",
    "bytes": "trtdisagg_kv_transfer_bytes_total",
    "transfers": "trtdisagg_kv_transfer_seconds_count",
}


def counters(http: httpx.Client, server: Server) -> dict[str, float]:
    text = metrics_of(http, server)
    return {key: metric(text, name) for key, name in COUNTERS.items()}


def test_n_4_with_a_1k_token_prompt_prefills_once_and_transfers_once(
    cluster: Cluster, http: httpx.Client
) -> None:
    rng = random.Random(2024)  # a prompt no earlier request cached a block of
    prompt = [rng.randrange(10, 500) for _ in range(PROMPT_LEN)]
    ask = {
        "model": "tiny", "prompt": prompt, "n": 4, "max_tokens": 8, "temperature": 1.0,
        "seed": 17, "extra_body": {**IDS, "ignore_eos": True},
    }  # fmt: skip
    ctx_before, gen_before = counters(http, cluster.ctx), counters(http, cluster.gen)
    split = api(url_of(cluster, "coordinator")).completions.create(**ask)
    assert [c.index for c in split.choices] == [0, 1, 2, 3]
    assert split.usage is not None and split.usage.prompt_tokens == PROMPT_LEN
    assert split.usage.completion_tokens == 4 * 8
    expected_bytes = math.ceil(PROMPT_LEN / 16) * block_bytes(http, cluster)
    wait_until(
        lambda: counters(http, cluster.ctx)["transfers"] > ctx_before["transfers"],
        10,
        "ctx's write of the prompt's KV counted",
    )
    ctx, gen = counters(http, cluster.ctx), counters(http, cluster.gen)
    ctx_delta = {k: ctx[k] - ctx_before[k] for k in ctx}
    gen_delta = {k: gen[k] - gen_before[k] for k in gen}
    assert ctx_delta["prefill"] == PROMPT_LEN  # once, not once per choice
    assert ctx_delta["prompt"] == gen_delta["prompt"] == PROMPT_LEN
    assert ctx_delta["transfers"] == 1 and ctx_delta["bytes"] == expected_bytes
    assert gen_delta["prefill"] == 0  # gen computed none of it: it all came from ctx
    alone = api(url_of(cluster, "worker")).completions.create(**ask)
    assert tokens_of(alone) == tokens_of(split)
    assert len({tuple(t) for t in tokens_of(split)}) > 1  # the choices sample apart


def test_ctx_finishing_every_choice_answers_alone(cluster: Cluster) -> None:
    ask = {"model": "tiny", "prompt": PROMPTS[0], "n": 3, "max_tokens": 1, "temperature": 1.0,
           "seed": 3, "logprobs": 1, "extra_body": IDS}  # fmt: skip
    alone, split = (client.completions.create(**ask) for client in both(cluster))
    for answer in (alone, split):
        assert [c.finish_reason for c in answer.choices] == ["length"] * 3
        assert all(c.logprobs is not None and c.logprobs.tokens for c in answer.choices)
    assert tokens_of(alone) == tokens_of(split)
    assert [c.text for c in alone.choices] == [c.text for c in split.choices]


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_under_generation_first(
    cluster: Cluster, generation_first: Server, http: httpx.Client, stream: bool
) -> None:
    """ctx's first token of every choice comes with the KV (one transfer), not in its answer."""
    body = {"prompt": PROMPTS[1], "n": 3, "max_tokens": 6, "temperature": 1.0, "seed": 8,
            "ignore_eos": True, **IDS}  # fmt: skip
    alone = api(cluster.ctx.url).completions.create(
        model="tiny", **{k: v for k, v in body.items() if k in ("prompt", "n", "max_tokens",
                                                                 "temperature", "seed")},
        extra_body={**IDS, "ignore_eos": True},
    )  # fmt: skip
    url = generation_first.url + "/v1/completions"
    if stream:
        events = sse(http, url, {**body, "stream": True, "stream_options": {"include_usage": True}})
        assert_stream_shape(events, 3)
        split = [
            [t for c in cs for t in c["token_ids"]] for _, cs in sorted(by_choice(events).items())
        ]
    else:
        split = [c["token_ids"] for c in http.post(url, json=body).json()["choices"]]
    assert split == tokens_of(alone)


@pytest.mark.parametrize("n", [1, 2])
def test_echo_with_logprobs_gives_the_prompt_s_logprobs_split_or_not(
    cluster: Cluster, generation_first: Server, n: int
) -> None:
    ask = {"model": "tiny", "prompt": PROMPTS[2], "n": n, "max_tokens": 4, "temperature": 0,
           "echo": True, "logprobs": 2, "extra_body": {**IDS, "ignore_eos": True}}  # fmt: skip
    answers = [
        client.completions.create(**ask) for client in (*both(cluster), api(generation_first.url))
    ]
    num_prompt = len(answers[0].prompt_token_ids)
    reference = answers[0].choices[0].logprobs
    assert reference is not None and reference.tokens is not None
    assert len(reference.tokens) == num_prompt + 4
    assert reference.token_logprobs is not None and reference.token_logprobs[0] is None
    assert reference.top_logprobs is not None and reference.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in reference.token_logprobs[1:])
    offsets = reference.text_offset or []
    assert offsets == sorted(offsets) and offsets[0] == 0
    for answer in answers:
        assert tokens_of(answer) == tokens_of(answers[0])
        for choice in answer.choices:
            assert choice.text.startswith(PROMPTS[2])
            got = choice.logprobs
            assert got is not None and got.tokens == reference.tokens
            assert _close(list(got.token_logprobs or []), list(reference.token_logprobs))


def test_echo_with_logprobs_streams_the_prompt_with_the_first_token(
    cluster: Cluster, http: httpx.Client
) -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
            "stream": True}  # fmt: skip
    whole = api(cluster.ctx.url).completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    for target in TARGETS:
        chunks = by_choice(sse(http, url_of(cluster, target) + "/v1/completions", body))[0]
        assert chunks[0]["text"].startswith(PROMPTS[0])
        streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
        expected = whole.choices[0].logprobs
        assert expected is not None and expected.token_logprobs is not None
        assert streamed[0] is None and _close(streamed, list(expected.token_logprobs))
        assert "".join(c["text"] for c in chunks) == whole.choices[0].text


@pytest.mark.parametrize("target", [*TARGETS, "generation_first"])
def test_echo_with_max_tokens_0_scores_the_prompt_alone(
    cluster: Cluster, http: httpx.Client, generation_first: Server, target: str
) -> None:
    """Teacher-forced scoring (`max_tokens: 0, echo: true`): the prompt's text and logprobs,
    no token generated or counted, whole and streamed; the logprobs are those the same prompt
    gets echoed before a generated token."""
    ask = {"model": "tiny", "prompt": PROMPTS[1], "echo": True, "logprobs": 2, "temperature": 0}
    url = generation_first.url if target == "generation_first" else url_of(cluster, target)
    client = api(url)
    scored = client.completions.create(**ask, max_tokens=0)
    generated = client.completions.create(**ask, max_tokens=1)
    (choice,) = scored.choices
    assert choice.text == PROMPTS[1] and choice.finish_reason == "length"
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    assert generated.usage is not None
    assert scored.usage.prompt_tokens == generated.usage.prompt_tokens
    expected = generated.choices[0].logprobs
    assert choice.logprobs is not None and expected is not None and expected.tokens is not None
    assert choice.logprobs.tokens == expected.tokens[:-1]  # all but the generated token
    assert _close(
        list(choice.logprobs.token_logprobs or []), list(expected.token_logprobs or [])[:-1]
    )
    body = {**ask, "max_tokens": 0, "stream": True, "stream_options": {"include_usage": True}}
    events = sse(http, url + "/v1/completions", body)
    usage = assert_stream_shape(events, 1)
    assert usage["completion_tokens"] == 0
    chunks = by_choice(events)[0]
    assert "".join(c["text"] for c in chunks) == PROMPTS[1]
    streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert _close(streamed, list(choice.logprobs.token_logprobs or []))
    bare = client.completions.create(model="tiny", prompt=PROMPTS[1], echo=True, max_tokens=0)
    assert bare.choices[0].text == PROMPTS[1] and bare.choices[0].logprobs is None
    assert bare.usage is not None and bare.usage.completion_tokens == 0  # (generation_first too)


def _assert_scores(scores: Any, prompt: list[int], echoed: Any, top: int) -> None:
    """vLLM's prompt_logprobs of `prompt` against the echo of the same prompt with logprobs:
    the same logprob and text for each token, the `top` best ranked 1.. in order, the token's
    own rank consistent with them."""
    assert echoed.token_logprobs is not None and echoed.tokens is not None
    assert isinstance(scores, list) and len(scores) == len(prompt) and scores[0] is None
    for i, (token, entry) in enumerate(zip(prompt[1:], scores[1:], strict=True), start=1):
        own = entry[str(token)]
        assert abs(own["logprob"] - echoed.token_logprobs[i]) < LOGPROB_TOLERANCE
        assert own["decoded_token"] == echoed.tokens[i]
        best = sorted((e for k, e in entry.items() if k != str(token) or e["rank"] <= top),
                      key=lambda e: e["rank"])  # fmt: skip
        assert [e["rank"] for e in best] == list(range(1, top + 1))
        assert all(a["logprob"] >= b["logprob"] for a, b in itertools.pairwise(best))
        assert len(entry) == top + (own["rank"] > top)  # the token once, in the top or after it
        assert own["rank"] >= 1 and (own["rank"] > top) == (own["logprob"] < best[-1]["logprob"])


@pytest.mark.parametrize("n", [1, 2])
def test_prompt_logprobs_are_vllm_s_split_or_not(
    cluster: Cluster, generation_first: Server, n: int
) -> None:
    """Each choice's prompt_logprobs: computed by ctx's prefill, carried to gen, and equal to
    the prompt's echoed logprobs, worker alone, split context-first and generation-first."""
    ask = {"model": "tiny", "prompt": PROMPTS[1], "n": n, "max_tokens": 3, "temperature": 0,
           "extra_body": {**IDS, "prompt_logprobs": 2}}  # fmt: skip
    echo = api(cluster.ctx.url).completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    echoed = echo.choices[0].logprobs
    for client in (*both(cluster), api(generation_first.url)):
        answer = client.completions.create(**ask)
        prompt = list(answer.prompt_token_ids)  # type: ignore[attr-defined]
        assert len(answer.choices) == n
        for choice in answer.choices:
            _assert_scores(getattr(choice, "prompt_logprobs", None), prompt, echoed, 2)
            assert choice.logprobs is None  # not asked for


@pytest.mark.parametrize("target", TARGETS)
def test_prompt_logprobs_of_chat_and_of_streams(
    cluster: Cluster, http: httpx.Client, target: str
) -> None:
    """Chat's at the answer's top, whole and streamed once; completions' streamed in each
    choice's first chunk; each equal to the whole answer's, and to the worker alone's."""
    url = url_of(cluster, target)
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 3, "temperature": 0,
            "prompt_logprobs": 1}  # fmt: skip
    whole = http.post(url + "/v1/chat/completions", json=chat).json()
    alone = http.post(cluster.ctx.url + "/v1/chat/completions", json=chat).json()
    scores = whole["prompt_logprobs"]
    assert len(scores) == whole["usage"]["prompt_tokens"] and scores[0] is None
    assert _same_scores(scores, alone["prompt_logprobs"])
    events = sse(http, url + "/v1/chat/completions", {**chat, "n": 2, "stream": True})
    streamed = [
        e["prompt_logprobs"] for e in events if isinstance(e, dict) and "prompt_logprobs" in e
    ]
    assert len(streamed) == 1 and _same_scores(streamed[0], scores)
    plain = {"model": "tiny", "prompt": PROMPTS[0], "n": 2, "max_tokens": 3, "temperature": 0,
             "prompt_logprobs": 2}  # fmt: skip
    whole = http.post(url + "/v1/completions", json=plain).json()
    events = sse(http, url + "/v1/completions", {**plain, "stream": True})
    for index, chunks in by_choice(events).items():
        assert _same_scores(
            chunks[0]["prompt_logprobs"], whole["choices"][index]["prompt_logprobs"]
        )
        assert all("prompt_logprobs" not in c for c in chunks[1:])


def _same_scores(a: list[Any], b: list[Any]) -> bool:
    """Two prompt_logprobs lists alike: the same tokens and ranks, logprobs within rounding."""
    return len(a) == len(b) and all(
        (x is None and y is None)
        or (
            x is not None and y is not None and x.keys() == y.keys()
            and all(x[k]["rank"] == y[k]["rank"] for k in x)
            and all(abs(x[k]["logprob"] - y[k]["logprob"]) < LOGPROB_TOLERANCE for k in x)
        )
        for x, y in zip(a, b, strict=True)
    )  # fmt: skip


def test_best_of_answers_the_best_candidates(cluster: Cluster) -> None:
    ask = {"model": "tiny", "prompt": PROMPTS[:2], "max_tokens": 5, "temperature": 1.0,
           "seed": 41, "extra_body": {"ignore_eos": True}}  # fmt: skip
    for client in both(cluster):
        best = client.completions.create(**ask, n=2, best_of=4)
        assert [c.index for c in best.choices] == [0, 1, 2, 3]
        assert all(c.logprobs is None for c in best.choices)  # not asked for
        assert best.usage is not None and best.usage.completion_tokens == 2 * 4 * 5
        every = client.completions.create(**ask, n=4, logprobs=0)  # the same 4 candidates
        for p in range(2):
            candidates = every.choices[4 * p : 4 * p + 4]
            scores = [sum(_values(c.logprobs)) for c in candidates]
            ranked = [candidates[i].text for i in sorted(range(4), key=lambda i: -scores[i])]
            assert [c.text for c in best.choices[2 * p : 2 * p + 2]] == ranked[:2]


@pytest.mark.parametrize("target", TARGETS)
def test_best_of_streams_its_best_choices_whole_at_the_end(
    cluster: Cluster, http: httpx.Client, target: str
) -> None:
    body = {"prompt": PROMPTS[0], "n": 2, "best_of": 3, "max_tokens": 4, "temperature": 1.0,
            "seed": 12, "ignore_eos": True}  # fmt: skip
    url = url_of(cluster, target) + "/v1/completions"
    whole = http.post(url, json=body).json()
    events = sse(http, url, {**body, "stream": True, "stream_options": {"include_usage": True}})
    usage = assert_stream_shape(events, 2)
    streamed = [cs for _, cs in sorted(by_choice(events).items())]
    assert all(len(chunks) == 1 for chunks in streamed)  # each chosen choice in one chunk
    assert [cs[0]["text"] for cs in streamed] == [c["text"] for c in whole["choices"]]
    assert usage == whole["usage"]


def _close(a: list[float | None], b: list[float | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None)
        or (x is not None and y is not None and abs(x - y) < LOGPROB_TOLERANCE)
        for x, y in zip(a, b, strict=True)
    )


def _values(logprobs: Any) -> list[float]:
    assert logprobs is not None and logprobs.token_logprobs is not None
    return [float(v) for v in logprobs.token_logprobs]
