"""The sampling controls (`logit_bias`, presence, frequency and repetition penalties, `min_p`,
vLLM's `allowed_token_ids` and `bad_words`)
through the official `openai` client, against the worker alone and through the coordinator
(`tests/openai_cluster.py`, shared with the other modules that only send it requests): each changes
the output the way it should, and the worker and the ctx → gen split give the same tokens, greedy
and seeded.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import httpx
import openai
import pytest

from tests.edges import Cluster
from tests.openai_cluster import CHAT, IDS, PROMPTS, both, tokens_of
from trtdisagg.model.loader import resolve_model
from trtdisagg.worker.tokenization import Tokenizer

pytestmark = pytest.mark.timeout(300)

TOKEN = 100  # an ordinary token of `tiny` (not a special one)
# A bias that makes the greedy output repeat TOKEN often, without forcing it every time: what
# the penalties act on.
NUDGE = {str(TOKEN): 6}


@pytest.fixture(scope="module")
def cluster(shared_cluster: tuple[Cluster, httpx.Client]) -> Cluster:
    return shared_cluster[0]


def _complete(client: openai.OpenAI, **ask: Any) -> list[int]:
    extra = {**IDS, "ignore_eos": True, **ask.pop("extra_body", {})}
    ask = {"max_tokens": 40, **ask}
    answer = client.completions.create(model="tiny", prompt=PROMPTS[1], extra_body=extra, **ask)
    return tokens_of(answer)[0]


def _chat(client: openai.OpenAI, **ask: Any) -> list[int]:
    extra = {**IDS, "ignore_eos": True, **ask.pop("extra_body", {})}
    answer = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=12, extra_body=extra, **ask
    )
    return list(answer.choices[0].token_ids)  # type: ignore[attr-defined]


# ---- each control acts ----


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 7)])
def test_a_logit_bias_of_100_makes_the_token_the_output(
    cluster: Cluster, temperature: float, seed: int | None
) -> None:
    for client in both(cluster):
        ask = {"temperature": temperature, "seed": seed, "logit_bias": {str(TOKEN): 100}}
        assert _complete(client, **ask) == [TOKEN] * 40
        assert _chat(client, **ask) == [TOKEN] * 12
        first = _complete(client, temperature=0.0, max_tokens=1)[0]
        banned = _complete(client, temperature=0.0, max_tokens=1, logit_bias={str(first): -100})
        assert banned[0] != first


def test_penalties_change_the_repeats_the_way_they_should(cluster: Cluster) -> None:
    """Greedy, with TOKEN nudged into repeating: a positive penalty repeats it less than no
    penalty does, a negative frequency or presence penalty more."""

    def repeats(client: openai.OpenAI, **penalties: float) -> int:
        tokens = _complete(client, temperature=0.0, logit_bias=NUDGE, extra_body=penalties)
        return tokens.count(TOKEN)

    for client in both(cluster):
        free = repeats(client)
        assert free >= 5, "the nudge makes TOKEN repeat"
        assert repeats(client, repetition_penalty=2.0) < free
        assert repeats(client, frequency_penalty=2.0) < free
        assert repeats(client, presence_penalty=2.0) < free
        assert repeats(client, frequency_penalty=-0.5) > free
        assert repeats(client, presence_penalty=-1.0) > free


def test_min_p_removes_the_low_probability_tokens(cluster: Cluster) -> None:
    """At temperature 1 the reported logprobs are the sampled distribution's, so every token
    min_p keeps has logprob >= log(min_p) + the most likely token's; without it, some have
    less."""
    min_p = 0.3

    def below(client: openai.OpenAI, seed: int, **ask: Any) -> int:
        answer = client.completions.create(
            model="tiny", prompt=PROMPTS[1], max_tokens=30, temperature=1.0, seed=seed,
            logprobs=1, extra_body={"ignore_eos": True, **ask},
        )  # fmt: skip
        logprobs = answer.choices[0].logprobs
        assert logprobs is not None and logprobs.top_logprobs and logprobs.token_logprobs
        best = [max(top.values()) for top in logprobs.top_logprobs]
        chosen = logprobs.token_logprobs
        assert len(chosen) == 30
        return sum(lp < math.log(min_p) + b - 1e-5 for lp, b in zip(chosen, best, strict=True))

    for client in both(cluster):
        assert sum(below(client, seed) for seed in (0, 1)) > 0
        assert below(client, 0, min_p=min_p) == below(client, 1, min_p=min_p) == 0
        greedy = _complete(client, temperature=0.0)
        assert _complete(client, temperature=1.0, seed=3, extra_body={"min_p": 1.0}) == greedy


@pytest.mark.parametrize(
    "controls",
    [
        {"extra_body": {"repetition_penalty": 1e-300, "min_p": 1.0}, "top_p": 0.5},
        {"extra_body": {"repetition_penalty": 1e300}, "presence_penalty": -2,
         "frequency_penalty": 2},
        {"logit_bias": {str(t): (-1) ** t * 100 for t in range(40)}},
    ],
)  # fmt: skip
def test_extreme_but_valid_controls_are_served(cluster: Cluster, controls: dict[str, Any]) -> None:
    """Penalties that overflow float32 (the logits reach ±inf) and many extreme biases: the
    answer is still whole, with finite logprobs (the model's, before the controls)."""
    ask = dict(controls)
    extra = {**IDS, "ignore_eos": True, **ask.pop("extra_body", {})}
    for client in both(cluster):
        answer = client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=1.0, seed=1, logprobs=2,
            extra_body=extra, **ask,
        )  # fmt: skip
        choice = answer.choices[0]
        assert len(choice.token_ids) == 4  # type: ignore[attr-defined]
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        assert all(math.isfinite(lp) for lp in choice.logprobs.token_logprobs)


# ---- the worker and the split agree ----


CONTROLS: dict[str, dict[str, Any]] = {
    "logit_bias": {"logit_bias": {**NUDGE, "7": -50, "300": 2.5}},
    "presence_penalty": {"presence_penalty": 1.5, "logit_bias": NUDGE},
    "frequency_penalty": {"frequency_penalty": -0.8},
    "repetition_penalty": {"extra_body": {"repetition_penalty": 1.7}, "logit_bias": NUDGE},
    "min_p": {"extra_body": {"min_p": 0.2}},
    "together": {
        "presence_penalty": -0.5, "frequency_penalty": 0.7, "logit_bias": NUDGE, "top_p": 0.9,
        "extra_body": {"repetition_penalty": 1.2, "min_p": 0.05, "top_k": 40},
    },
}  # fmt: skip


@pytest.mark.parametrize("controls", list(CONTROLS.values()), ids=list(CONTROLS))
@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 31)])
def test_each_control_gives_the_same_tokens_split_or_not(
    cluster: Cluster, controls: dict[str, Any], temperature: float, seed: int | None
) -> None:
    worker, coordinator = both(cluster)
    for route in (_complete, _chat):
        ask = {"temperature": temperature, "seed": seed, **controls}
        alone = route(worker, **ask)
        assert route(coordinator, **ask) == alone
        assert route(worker, **ask) == alone  # and a seeded request repeats
    if temperature > 0 or "min_p" not in controls.get("extra_body", {}):  # min_p: greedy's own
        plain = _complete(worker, temperature=temperature, seed=seed)
        assert _complete(worker, temperature=temperature, seed=seed, **controls) != plain


# ---- vLLM's text extensions ----


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(cluster: Cluster) -> None:
    """The text ends after the stop string that ended it, streamed or not; without the flag,
    before it."""
    for client in both(cluster):
        ask: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 24,
                               "temperature": 0}  # fmt: skip
        full = client.completions.create(**ask, extra_body={"ignore_eos": True}).choices[0].text
        stop = next(full[i : i + 3] for i in range(4, 12) if "\ufffd" not in full[i : i + 3])
        end = full.find(stop)
        include = {"include_stop_str_in_output": True}
        kept = client.completions.create(**ask, stop=[stop, "never said"], extra_body=include)
        assert kept.choices[0].text == full[: end + len(stop)], (full, stop)
        assert kept.choices[0].finish_reason == "stop"
        streamed = client.completions.create(**ask, stop=[stop], extra_body=include, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == full[: end + len(stop)]
        cut = client.completions.create(**ask, stop=[stop])
        assert cut.choices[0].text == full[:end]


def test_skip_special_tokens_false_keeps_their_text(cluster: Cluster) -> None:
    """`tiny`'s token 5 is `<|assistant|>`, a special token: dropped from the text unless the
    request keeps it, streamed or not, in both routes."""
    bias = {"5": 100}
    for client in both(cluster):
        ask: dict[str, Any] = {"model": "tiny", "max_tokens": 3, "temperature": 0,
                               "logit_bias": bias}  # fmt: skip
        plain = client.completions.create(prompt=PROMPTS[2], **ask)
        assert plain.choices[0].text == ""
        keep = {"skip_special_tokens": False}
        kept = client.completions.create(prompt=PROMPTS[2], extra_body=keep, **ask)
        assert kept.choices[0].text == "<|assistant|>" * 3
        chat = client.chat.completions.create(messages=CHAT, extra_body=keep, stream=True, **ask)
        text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        assert text == "<|assistant|>" * 3


# ---- vLLM's token bans ----


def test_allowed_token_ids_keep_every_token_in_the_set(cluster: Cluster) -> None:
    """Greedy and seeded, each route, worker and split alike: every token is one of the set,
    and the set is not one the free run keeps to."""
    worker, coordinator = both(cluster)
    free = _complete(worker, temperature=0.0)
    allowed = sorted({free[3], free[7], TOKEN})
    assert not set(free) <= set(allowed)
    extra = {"extra_body": {"allowed_token_ids": allowed}}
    for temperature, seed in ((0.0, None), (1.0, 5)):
        for route in (_complete, _chat):
            got = route(worker, temperature=temperature, seed=seed, **extra)
            assert set(got) <= set(allowed), got
            assert route(coordinator, temperature=temperature, seed=seed, **extra) == got


def test_bad_words_leave_the_free_run_where_a_word_would_end(cluster: Cluster) -> None:
    """A word the free greedy run spells with its first two tokens, sent as text: worker and
    split leave the run at its second token (on gen: right after ctx's first) and never spell
    it; a word of one token never appears."""
    tokenizer = Tokenizer.from_dir(resolve_model("tiny"))
    worker, coordinator = both(cluster)
    free = _complete(worker, temperature=0.0)
    word = tokenizer.decode(free[:2])
    spellings = {tuple(tokenizer.encode(w, add_special_tokens=False))
                 for w in (word.lstrip(), " " + word.lstrip())}  # fmt: skip
    assert tuple(free[:2]) in spellings, (word, spellings)  # the test needs a clean word
    for client in (worker, coordinator):
        got = _complete(client, temperature=0.0, extra_body={"bad_words": [word]})
        assert got[0] == free[0] and got[1] != free[1]
        assert all((a, b) != tuple(free[:2]) for a, b in itertools.pairwise(got))
    single = tokenizer.decode([TOKEN])
    for client in (worker, coordinator):
        nudged = {"logit_bias": NUDGE}
        assert TOKEN in _complete(client, temperature=0.0, **nudged)
        banned = _complete(client, temperature=0.0, extra_body={"bad_words": [single]}, **nudged)
        assert TOKEN not in banned
