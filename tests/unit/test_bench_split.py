"""tools/bench_split.py's summary: per-prompt differences between the three paths."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_split


def test_the_differences_are_taken_per_prompt_not_between_percentiles() -> None:
    # The machine stalled on different prompts for different paths: per prompt, the handover
    # is 5, -30 and 49 ms (p50 5 ms); p50(manual) - p50(direct) would say 9 ms.
    times = {
        "direct": [0.010, 0.050, 0.011],
        "manual": [0.015, 0.020, 0.060],
        "coordinator": [0.017, 0.022, 0.062],
    }
    text, document = bench_split.report(times)
    handover = document["manual - direct (handover)"]
    own = document["coordinator - manual (the coordinator itself)"]
    assert handover["p50_ms"] == pytest.approx(5.0)
    assert own["p50_ms"] == pytest.approx(2.0) and own["p90_ms"] == pytest.approx(2.0)
    assert text.splitlines()[-1] == "coordinator_added_ms_p50=2.00"


def test_bad_arguments_are_refused_with_the_rule() -> None:
    with pytest.raises(SystemExit):
        bench_split.main(["--output-len", "1"])  # ctx would finish the request itself


async def test_the_client_side_split_asks_ctx_for_the_kv_and_hands_its_params_to_gen() -> None:
    """The split the tool does by hand speaks the coordinator's protocol (built with its own
    `coordinator.split` helpers): a context_only leg under the given key, then a generation_only
    leg carrying ctx's params and prompt ids."""
    seen: dict[str, dict[str, Any]] = {}

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen[request.url.host] = body
        if request.url.host == "ctx":
            params = {**body["disaggregated_params"], "ctx_request_id": 7}
            choice = {"index": 0, "finish_reason": None, "disaggregated_params": params}
            return httpx.Response(200, json={"choices": [choice], "prompt_token_ids": [5, 6]})
        choice = {"index": 0, "finish_reason": "length", "token_ids": [9, 8]}
        return httpx.Response(200, json={"choices": [choice]})

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        body = {"prompt": "hi", "max_tokens": 2}
        tokens = await bench_split.manual_split(client, "http://ctx", "http://gen", body, key=42)
    assert tokens == [9, 8]
    ctx_params = seen["ctx"]["disaggregated_params"]
    assert ctx_params["request_type"] == "context_only" and ctx_params["transfer_key"] == 42
    gen_params = seen["gen"]["disaggregated_params"]
    assert gen_params["request_type"] == "generation_only"
    assert gen_params["transfer_key"] == 42 and gen_params["ctx_request_id"] == 7
    assert seen["gen"]["prompt_token_ids"] == [5, 6]
