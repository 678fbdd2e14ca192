"""Per-request phase timings (`return_perf_metrics: true`). Pure.

The coordinator stamps the phases it sees (monotonic seconds) and merges them with what the
workers report under ``perf_metrics``::

    coordinator_queue_s   arrival → first leg posted (tokenizing, routing)
    ctx_s                 ctx leg round trip (prefill + first token)
    kv_transfer_s / _bytes  gen's own report of the KV transfer, when it gives one
    gen_first_token_s     gen leg posted → its first token (gen's repeat of ctx's when the
                          client had that from ctx's answer; gen's own first_token_s when
                          no token came through the coordinator)
    decode_s              gen first token → last token
    e2e_s                 arrival → answer complete
    ctx, gen              the workers' own perf_metrics, as they sent them
"""

from __future__ import annotations

from typing import Any

import attrs

Json = dict[str, Any]


def _span(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return round(end - start, 6)


def _number(metrics: Json | None, key: str) -> Any:
    if metrics is None:
        return None
    value = metrics.get(key)
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


@attrs.define(eq=False, kw_only=True)
class PhaseClock:
    arrival: float
    ctx_start: float | None = None
    ctx_end: float | None = None
    gen_start: float | None = None
    gen_first_token: float | None = None
    gen_end: float | None = None

    def merged(self, *, ctx: Json | None, gen: Json | None, now: float) -> Json:
        first_leg = self.ctx_start if self.ctx_start is not None else self.gen_start
        gen_first = _span(self.gen_start, self.gen_first_token)
        decode = _span(self.gen_first_token, self.gen_end if self.gen_end is not None else now)
        if gen_first is None:
            gen_first = _number(gen, "first_token_s")
            decode = _number(gen, "decode_s")
        out: Json = {
            "coordinator_queue_s": _span(self.arrival, first_leg),
            "ctx_s": _span(self.ctx_start, self.ctx_end),
            "kv_transfer_s": _number(gen, "kv_transfer_s"),
            "kv_transfer_bytes": _number(gen, "kv_transfer_bytes"),
            "gen_first_token_s": gen_first,
            "decode_s": decode,
            "e2e_s": _span(self.arrival, now),
            "ctx": ctx,
            "gen": gen,
        }
        return {k: v for k, v in out.items() if v is not None}
