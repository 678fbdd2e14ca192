"""Compare grammar engines on a model's tokenizer: compile time, mask time, and whether constrained
random walks give valid JSON (docs/BENCHMARKS.md, "Grammar engines").

Each engine compiles 40 grammars, 8 each of 5 JSON schemas, and walks each one: at every step a
token is drawn uniformly among those its mask allows (up to 300 tokens), until end-of-sequence or
the grammar ends. The decoded text must parse with strict `json.loads` and validate against its
schema. An engine that is not installed is reported as such.

    TINY=$(python -c 'from trtdisagg.model.loader import resolve_model as r; print(r("tiny"))')
    python tools/eval_grammar_engines.py "$TINY"

Needs `transformers` (both engines read the tokenizer through it) and `jsonschema`; `llguidance`
(a dependency of trtdisagg) and, for the comparison, `xgrammar`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

Json = dict[str, Any]
TRIALS = 40
MAX_TOKENS = 300

SCHEMAS: list[Json] = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age"],
     "properties": {"name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 150}}},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "additionalProperties": False, "required": ["color"],
     "properties": {"color": {"enum": ["red", "green", "blue"]}}},
    {"type": "object", "additionalProperties": False, "required": ["a"],
     "properties": {"a": {"type": "object", "additionalProperties": False, "required": ["b"],
                          "properties": {"b": {"type": "boolean"}}}}},
    {"type": "number", "minimum": -5, "maximum": 5},
]  # fmt: skip


def _report(name: str, init: float, compiles: list[float], masks: list[float], ok: int) -> None:
    p99 = sorted(masks)[int(len(masks) * 0.99)]
    print(
        f"{name}: tokenizer init {init * 1e3:.1f} ms; compile p50 "
        f"{statistics.median(compiles) * 1e3:.2f} ms max {max(compiles) * 1e3:.1f}; mask p50 "
        f"{statistics.median(masks) * 1e6:.1f} us p99 {p99 * 1e6:.1f}; valid {ok}/{TRIALS}"
    )


def _check(name: str, text: str, schema: Json) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as exc:
        print(f"{name} invalid {text[:120]!r} {type(exc).__name__}")
        return False
    return True


def run_llguidance(hf: Any, vocab: int, eos: int) -> None:
    import llguidance
    import llguidance.hf

    start = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(hf, vocab)
    init = time.perf_counter() - start
    compiles, masks, ok = [], [], 0
    rng = random.Random(0)
    for trial in range(TRIALS):
        schema = SCHEMAS[trial % len(SCHEMAS)]
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False}
        )
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        compiles.append(time.perf_counter() - start)
        assert not matcher.is_error(), matcher.get_error()
        out: list[int] = []
        for _ in range(MAX_TOKENS):
            start = time.perf_counter()
            mask = matcher.compute_bitmask()
            masks.append(time.perf_counter() - start)
            allowed = [i for i in range(vocab) if (mask[i // 8] >> (i % 8)) & 1]
            token = rng.choice(allowed)
            if token == eos or matcher.is_stopped():
                break
            assert matcher.consume_token(token), matcher.get_error()
            out.append(token)
            if matcher.is_stopped():
                break
        ok += _check("llguidance", hf.decode(out), schema)
    _report("llguidance", init, compiles, masks, ok)


def run_xgrammar(hf: Any, vocab: int, eos: int) -> None:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    init = time.perf_counter() - start
    compiles, masks, ok = [], [], 0
    rng = random.Random(0)
    for trial in range(TRIALS):
        schema = SCHEMAS[trial % len(SCHEMAS)]
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        matcher = xgrammar.GrammarMatcher(compiled)
        compiles.append(time.perf_counter() - start)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        out: list[int] = []
        for _ in range(MAX_TOKENS):
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            masks.append(time.perf_counter() - start)
            logits = torch.zeros(1, vocab)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)
            allowed = torch.nonzero(logits[0] > -1e30).flatten().tolist()
            token = rng.choice(allowed)
            if matcher.is_terminated():
                break
            assert matcher.accept_token(token)
            if token == eos or matcher.is_terminated():
                break
            out.append(token)
        ok += _check("xgrammar", hf.decode(out), schema)
    _report("xgrammar", init, compiles, masks, ok)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, help="a model directory with tokenizer.json")
    args = parser.parse_args()
    from transformers import PreTrainedTokenizerFast

    config = json.loads((args.model_dir / "config.json").read_text())
    vocab, eos = int(config["vocab_size"]), int(config.get("eos_token_id", 0))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(args.model_dir / "tokenizer.json"))
    hf.eos_token = hf.convert_ids_to_tokens(eos)
    for name, run in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
        try:
            run(hf, vocab, eos)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")


if __name__ == "__main__":
    main()
