"""The coordinator's own calls to a worker carry its API key (`/kv_cache_events` needs it)."""

from __future__ import annotations

import httpx

from trtdisagg.coordinator.upstream import WorkerClient


async def test_kv_events_are_drained_with_the_coordinator_s_key() -> None:
    seen: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Authorization"))
        return httpx.Response(200, json=[])

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        for key in ("sk-1", None):
            client = WorkerClient(http=http, api_key=key)
            assert await client.post_for_json("http://w", "/kv_cache_events", limit_s=1,
                                              role="context") == []  # fmt: skip
    assert seen == ["Bearer sk-1", None]
    assert "sk-1" not in repr(WorkerClient(http=http, api_key="sk-1"))
