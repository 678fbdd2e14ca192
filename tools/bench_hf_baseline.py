"""The reference point for bench_serving: the same requests through HF `transformers` generate().

Batch 1, one request after another, greedy, `min_new_tokens = max_new_tokens` so every request
produces exactly its output length. With the same --seed, --input-len, --output-len,
--range-ratio and --vocab-size as a (non-mixed) bench_serving run, the prompts are the same token
ids (`_bench_common.iter_requests`, class "all").

Timing comes from a streamer that generate() calls once with the prompt and once per new token:
TTFT is the prefill (send -> first token), ITL the gaps between tokens, TPOT and E2E as in
bench_serving. `--plain-loop` times a bare greedy loop instead (the model called with its KV
cache, argmax, one token at a time: generate() without its per-token bookkeeping). Throughput is
per second of the sum of the requests' wall times. The result file has the same shape as
bench_serving's, so plot_bench reads both.

    python tools/bench_hf_baseline.py --model-dir tiny --input-len 64 --output-len 32 \\
        --num-requests 16 --vocab-size 512 --result-json out/hf.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from _bench_common import (
    LengthRange,
    ProgressBar,
    RequestRecord,
    RequestSpec,
    Slo,
    format_summary,
    make_requests,
    result_document,
    summarize_by_class,
    write_result,
)


def resolve_model_dir(name: str) -> Path:
    """Resolve "tiny" (the embedded checkpoint, written on first use) or a directory."""
    if name == "tiny":
        try:
            from trtdisagg.model.tiny import ensure_tiny_checkpoint
        except ImportError as error:
            raise SystemExit(f"--model-dir tiny needs trtdisagg.model.tiny ({error})") from None
        path: Path = ensure_tiny_checkpoint()
        return path
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model-dir {name}: no config.json there")
    return path


@attrs.define(eq=False)
class TimingStreamer:
    """A generate() streamer that timestamps tokens. The first put() is the prompt itself."""

    sent_at: float
    prompt_seen: bool = False
    token_times: list[float] = attrs.Factory(list)
    tokens: int = 0
    ended_at: float | None = None

    def put(self, value: Any) -> None:
        now = time.perf_counter()  # value arrived via .cpu(): the step's work is done
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.token_times.append(now)
        self.tokens += int(value.numel())

    def end(self) -> None:
        self.ended_at = time.perf_counter()

    def record(self, spec: RequestSpec, t0: float) -> RequestRecord:
        times = self.token_times
        end = self.ended_at if self.ended_at is not None else time.perf_counter()
        return RequestRecord(
            cls=spec.cls,
            index=spec.index,
            input_len=spec.input_len,
            output_len=spec.output_len,
            ok=bool(times),
            error=None if times else "generate() produced no tokens",
            start_s=self.sent_at - t0,
            ttft_s=times[0] - self.sent_at if times else None,
            e2e_s=end - self.sent_at,
            itl_s=tuple(b - a for a, b in itertools.pairwise(times)),
            prompt_tokens=spec.input_len,
            output_tokens=self.tokens,
        )


def plain_loop(model: Any, ids: Any, new_tokens: int, streamer: TimingStreamer) -> None:
    """Greedy decoding by hand: one forward over the prompt, then one per token, with HF's KV
    cache; each token's argmax is read on the host (a sync), as a server would."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        for _ in range(new_tokens):
            token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            streamer.put(token.cpu())
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
    streamer.end()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-dir", required=True, help='"tiny" or a local HF checkpoint directory')
    p.add_argument("--input-len", default="512", help='prompt tokens: "N" or "LO:HI"')
    p.add_argument("--output-len", default="128", help='output tokens: "N" or "LO:HI"')
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--vocab-size", type=int, default=256, help="prompt ids uniform in [0, V)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1, help="requests run first, not measured")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--plain-loop", action="store_true", help="a bare greedy loop, not generate()")
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--label", default="hf-baseline")
    p.add_argument("--result-json", type=Path)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model_dir)
    device = torch.device(args.device)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    model.to(device=device)  # from_pretrained() returns the model in eval mode
    if args.vocab_size > model.config.vocab_size:
        raise SystemExit(f"--vocab-size {args.vocab_size} > the model's {model.config.vocab_size}")

    input_len = LengthRange.parse(args.input_len, args.range_ratio)
    output_len = LengthRange.parse(args.output_len, args.range_ratio)

    def specs(cls: str, n: int) -> list[RequestSpec]:
        return make_requests(cls, n, input_len=input_len, output_len=output_len,
                             vocab_size=args.vocab_size, seed=args.seed)  # fmt: skip

    warm, measured = specs("warmup", args.warmup), specs("all", args.num_requests)

    def run(spec: RequestSpec, t0: float) -> RequestRecord:
        ids = torch.tensor([spec.prompt_ids], dtype=torch.long, device=device)
        streamer = TimingStreamer(sent_at=time.perf_counter())
        streamer.prompt_seen = args.plain_loop  # the loop reports generated tokens only
        if args.plain_loop:
            plain_loop(model, ids, spec.output_len, streamer)
            return streamer.record(spec, t0)
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=spec.output_len, min_new_tokens=spec.output_len,
                streamer=streamer, pad_token_id=model.config.eos_token_id or 0,
            )  # fmt: skip
        return streamer.record(spec, t0)

    for spec in warm:
        run(spec, 0.0)
    progress = None if args.no_progress else ProgressBar(total=len(measured), label="hf ")
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    for spec in measured:
        records.append(run(spec, t0))
        if progress is not None:
            progress.update(len(records), sum(not r.ok for r in records))
    if progress is not None:
        progress.close(len(records), sum(not r.ok for r in records))
    busy = sum(r.e2e_s or 0.0 for r in records)
    slo = Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    summary = summarize_by_class(records, duration_s=busy, slo=slo)
    print(format_summary(f"bench_hf_baseline {args.label}", summary))
    if args.result_json is not None:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        config |= {"resolved_model_dir": str(model_dir), "batch_size": 1, "concurrency": 1}
        doc = result_document(
            tool="bench_hf_baseline",
            label=args.label,
            config=config,
            summary=summary,
            records=records,
        )
        write_result(args.result_json, doc)
        print(f"wrote {args.result_json}", file=sys.stderr)
    return 0 if all(r.ok for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
