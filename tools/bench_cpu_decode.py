"""CPU decode step time, eager against `cpu_compile`'s compiled step, per batch size.

Loads a model as a CPU worker does with `cpu_compile: true` (the two graphs compiled at start),
then times the forward of one decode step (inputs built, forward, logits) at each batch size,
every sequence at `--context` tokens in its own blocks: eagerly (the runner's batched decode,
`DecodeStaging` + `CausalLM.forward` through `TorchOps`) and compiled (`CompiledDecode`), in
interleaved rounds, since this VM's speed drifts. Each figure is the median over rounds of a
round's mean. Steps above `compiled_decode.MAX_BATCH` run eagerly in a worker; they are timed
here to show where the compiled step stops paying.

    python tools/bench_cpu_decode.py --batches 1,2,4,8,16,32 --context 200
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch

from trtdisagg import LLM
from trtdisagg.worker.decode_graphs import DecodeRows, DecodeStaging


def rows_of(batch: int, context: int, tokens_per_block: int) -> DecodeRows:
    blocks = math.ceil(context / tokens_per_block)
    last = context - 1
    return DecodeRows(
        token_ids=[5] * batch,
        positions=[last] * batch,
        slots=[(i * blocks + last // tokens_per_block) * tokens_per_block
               + last % tokens_per_block for i in range(batch)],
        context_lens=[context] * batch,
        block_tables=[list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)],
    )  # fmt: skip


def mean_ms(step: Callable[[], object], iters: int) -> float:
    step()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tokens_per_block = 32
    llm = LLM(
        args.model,
        cpu_compile=True,
        kv_cache_config={"tokens_per_block": tokens_per_block, "max_tokens": 65536},
    )
    runner, compiled = llm.runner, llm.runner.compiled
    assert compiled is not None
    model, cache = runner.model, runner.cache

    def eager(rows: DecodeRows) -> Callable[[], object]:
        def step() -> object:
            staging = DecodeStaging.allocate(
                len(rows), rows.max_blocks, tokens_per_block=tokens_per_block, device=cache.device
            )
            return model(staging.fill(rows), cache)

        return step

    def fast(rows: DecodeRows) -> Callable[[], object]:
        return lambda: compiled(compiled.batch(rows))

    print(f"{args.model}, context {args.context}, ms per step (median of {args.rounds} rounds)")
    print(f"{'batch':>5} {'eager':>8} {'compiled':>9} {'ratio':>6}")
    with torch.inference_mode():
        for batch in (int(b) for b in args.batches.split(",")):
            rows = rows_of(batch, args.context, tokens_per_block)
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            for _ in range(args.rounds):
                times["eager"].append(mean_ms(eager(rows), args.iters))
                times["compiled"].append(mean_ms(fast(rows), args.iters))
            e, c = (statistics.median(times[k]) for k in ("eager", "compiled"))
            print(f"{batch:>5} {e:>8.3f} {c:>9.3f} {c / e:>6.2f}")


if __name__ == "__main__":
    main()
