"""Output grammars from request to token masks (`api/grammars.py`, `worker/grammar.py`, the
sampler's mask and the output processor's matcher), on the tiny tokenizer.

Random walks through the masks always end in output that parses and validates; a gen that
replays ctx's first token masks its next one as ctx would have; EOS is allowed only once the
grammar accepts; a grammar that admits nothing more ends the request.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from tests.engine_parts import make_live
from tests.json_schemas import SCHEMAS
from trtdisagg.api.codec import parse_request
from trtdisagg.api.errors import ApiError
from trtdisagg.api.grammars import OutputGrammar, output_grammar
from trtdisagg.api.protocol import ChatCompletionRequest, CompletionRequest
from trtdisagg.api.tool_calls import HERMES, parse_tool_calls
from trtdisagg.model.loader import resolve_model
from trtdisagg.worker.engine.outputs import OutputProcessor, Token
from trtdisagg.worker.grammar import (
    GrammarCompiler,
    GrammarError,
    Matcher,
    allowed_tokens,
    allows_other_than,
)
from trtdisagg.worker.request import FinishReason
from trtdisagg.worker.sampling import SampleSpec, sample
from trtdisagg.worker.sampling_batch import allowed_mask
from trtdisagg.worker.tokenization import Tokenizer

CHAT = [{"role": "user", "content": "x"}]
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
        "required": ["city"], "additionalProperties": False}}}
    for name in ("get_weather", "get_time")
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(Path(resolve_model("tiny")))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(
        tokenizer_json=tokenizer.to_json(),
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=sorted(tokenizer.eos_token_ids),
    )


def chat(**fields: Any) -> ChatCompletionRequest:
    return parse_request({"messages": CHAT, **fields}, ChatCompletionRequest)


def schema_grammar(schema: dict[str, Any]) -> OutputGrammar:
    wanted = output_grammar(
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        ),
        HERMES,
    )
    assert wanted is not None
    return wanted


def allowed(matcher: Matcher) -> list[int]:
    masks = torch.from_numpy(allowed_tokens([matcher]))
    keep = allowed_mask(masks, matcher.vocab_size)[0]
    return torch.nonzero(keep).flatten().tolist()


def walk(matcher: Matcher, tokenizer: Tokenizer, seed: int, limit: int = 400) -> str:
    """Sample uniformly among the allowed tokens until EOS or the grammar ends."""
    rng, out = random.Random(seed), []
    eos = tokenizer.eos_token_ids
    for _ in range(limit):
        token = rng.choice(allowed(matcher))
        if token in eos:
            break
        assert matcher.advance(token)
        out.append(token)
        if matcher.is_stopped:
            break
    else:
        raise AssertionError("the walk did not end")
    return tokenizer.decode(out, skip_special_tokens=False)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_random_walks_through_a_schema_validate(
    index: int, compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    schema = SCHEMAS[index]
    template = compiler.compile(schema_grammar(schema))
    for seed in range(3):
        jsonschema.validate(json.loads(walk(template.matcher(), tokenizer, seed)), schema)


def test_eos_only_once_the_grammar_accepts(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    matcher = compiler.compile(schema_grammar({"type": "array", "maxItems": 1})).matcher()
    eos = tokenizer.eos_token_ids
    assert not eos & set(allowed(matcher))
    for token in tokenizer.encode("[]", add_special_tokens=False):
        assert matcher.advance(token)
    assert set(allowed(matcher)) == eos and matcher.is_stopped
    (mask,) = allowed_tokens([matcher])
    assert not allows_other_than(mask, eos)  # min_tokens' suppression then yields
    assert allows_other_than(mask, {0})


def test_json_object_is_any_object(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    wanted = output_grammar(chat(response_format={"type": "json_object"}), HERMES)
    assert wanted is not None
    matcher = compiler.compile(wanted).matcher()
    assert all(tokenizer.decode([t]).startswith("{") for t in allowed(matcher))
    for token in tokenizer.encode('{"a":[1,{"b":null}]}', add_special_tokens=False):
        assert not tokenizer.eos_token_ids & set(allowed(matcher))
        assert matcher.advance(token)
    assert set(allowed(matcher)) == tokenizer.eos_token_ids


def test_a_replayed_first_token_masks_the_next_as_the_sampler_would(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    template = compiler.compile(schema_grammar(SCHEMAS[0]))
    ctx, gen = template.matcher(), template.matcher()
    first = random.Random(1).choice(allowed(ctx))
    assert ctx.advance(first) and gen.advance(first)  # gen replays ctx's first token
    assert allowed(gen) == allowed(ctx)
    assert not gen.advance(tokenizer.encode("zz", add_special_tokens=False)[0])
    assert "zz" not in gen.error or gen.error


def test_a_sampled_token_is_always_allowed(compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(schema_grammar(SCHEMAS[2])).matcher()
    (mask,) = torch.from_numpy(allowed_tokens([matcher]))
    ok = set(allowed(matcher))
    logits = torch.randn(64, matcher.vocab_size) * 10
    for temperature in (0.0, 1.0):
        specs = [
            SampleSpec(params=_params(temperature), generator=torch.Generator().manual_seed(i),
                       allowed=mask)
            for i in range(64)
        ]  # fmt: skip
        tokens, _ = sample(logits, specs)
        assert set(tokens) <= ok


def test_the_output_processor_ends_a_request_whose_grammar_admits_nothing_more(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    processor = OutputProcessor(eos_token_ids=tokenizer.eos_token_ids, max_seq_len=4096)
    live, _ = make_live(max_tokens=50)
    live.grammar = compiler.compile(schema_grammar({"enum": ["yes"]})).matcher()
    tokens = tokenizer.encode('"yes"', add_special_tokens=False)
    endings = []
    for token in tokens:
        live.request.output_token_ids.append(token)
        [processed] = processor.process([Token(live=live, token_id=token)], 0.0)
        endings.append(processed.ending)
    assert endings[:-1] == [None] * (len(tokens) - 1)
    assert endings[-1] is not None and endings[-1].reason is FinishReason.STOP

    broken, _ = make_live(max_tokens=50)
    broken.grammar = compiler.compile(schema_grammar({"enum": ["yes"]})).matcher()
    bad = tokenizer.encode("no", add_special_tokens=False)[0]
    broken.request.output_token_ids.append(bad)
    [processed] = processor.process([Token(live=broken, token_id=bad)], 0.0)
    assert processed.ending is not None and processed.ending.reason is FinishReason.ERROR


def test_compiles_are_cached_and_matchers_independent(compiler: GrammarCompiler) -> None:
    wanted = schema_grammar({"type": "object", "properties": {"q": {"type": "integer"}}})
    first = compiler.compile(wanted)
    assert compiler.cached(wanted)
    one, two = first.matcher(), compiler.compile(wanted).matcher()
    assert one.advance(allowed(one)[0])
    assert allowed(two) == allowed(first.matcher())  # the copy did not move


@pytest.mark.parametrize(
    ("fields", "kind"),
    [
        ({"guided_regex": "[a-c]{2}x"}, "regex"),
        ({"guided_choice": ["up", "down.", "(x)"]}, "choice"),
        ({"structured_outputs": {"grammar": 'start: "a" | "b" "c"'}}, "lark"),
        ({"guided_json": '{"type": "boolean"}'}, "json"),
    ],
)
def test_every_kind_of_constraint_holds(
    fields: dict[str, Any], kind: str, compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    wanted = output_grammar(parse_request({"prompt": "x", **fields}, CompletionRequest), None)
    assert wanted is not None
    for seed in range(4):
        text = walk(compiler.compile(wanted).matcher(), tokenizer, seed)
        if kind == "json":
            json.loads(text)
        elif kind == "regex":
            assert len(text) == 3 and text[2] == "x" and set(text[:2]) <= set("abc")
        elif kind == "choice":
            assert text in ("up", "down.", "(x)")
        else:
            assert text in ("a", "bc")


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(
    ("choice", "parallel"), [("required", True), ("required", False), (NAMED, None)]
)
def test_forced_tool_calls_parse(
    choice: Any, parallel: bool | None, compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    wanted = output_grammar(
        chat(tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel), HERMES
    )
    assert wanted is not None and wanted.tool_calls
    for seed in range(4):
        parsed = parse_tool_calls(walk(compiler.compile(wanted).matcher(), tokenizer, seed), HERMES)
        assert parsed.content == "" and parsed.calls
        assert len(parsed.calls) == 1 or parallel
        for call in parsed.calls:
            assert call.name in ("get_weather", "get_time")
            assert set(json.loads(call.arguments)) == {"city"}
        if isinstance(choice, dict):
            assert {c.name for c in parsed.calls} == {"get_time"}


def test_refusals_name_their_field(compiler: GrammarCompiler) -> None:
    with pytest.raises(ApiError) as info:
        output_grammar(chat(tools=TOOLS, tool_choice="required"), None)  # no known format
    assert info.value.param == "tool_choice"
    unknown = schema_grammar({"type": "string", "format": "no-such-format"})
    strict = output_grammar(
        chat(response_format={"type": "json_schema", "json_schema": {
            "schema": {"type": "string", "format": "no-such-format"}, "strict": True}}),
        HERMES,
    )  # fmt: skip
    assert strict is not None
    compiler.compile(unknown)  # not strict: the keyword is ignored
    with pytest.raises(GrammarError, match="no-such-format"):
        compiler.compile(strict)


def _params(temperature: float) -> Any:
    from trtdisagg.worker.request import SamplingParams

    return SamplingParams(max_tokens=4, temperature=temperature)
