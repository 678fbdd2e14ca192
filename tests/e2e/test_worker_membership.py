"""A worker registers itself in a real etcd, and drains on SIGTERM: its key goes first, its
in-flight stream finishes whole, then it exits 0."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.etcd_server import Etcd, running_etcd, wait_for_members
from tests.procs import running_worker
from trtdisagg.membership.etcd import open_etcd
from trtdisagg.membership.etcd_wire import EventType
from trtdisagg.membership.records import decode_record, workers_prefix

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    with running_etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.mark.parametrize("api_server_count", [0, 1])
async def test_worker_registers_then_drains_on_sigterm(
    tmp_path: Path, etcd: Etcd, api_server_count: int
) -> None:
    """With a front process too: the stream it serves ends whole before the worker stops it."""
    name = f"drain{api_server_count}"
    cluster = {"etcd": etcd.url, "name": name, "lease_ttl_s": 3}
    prefix = workers_prefix(name)
    with running_worker(tmp_path, "gen", cluster=cluster, api_server_count=api_server_count) as gen:
        async with open_etcd(etcd.url) as client:
            answer = await wait_for_members(client, prefix, lambda a: bool(a.kvs), timeout=10)
            (kv,) = answer.kvs
            record = decode_record(kv.key, kv.value, cluster=name)
            assert (record.url, record.role, record.model) == (gen.url, "gen", "tiny")
            assert kv.key.endswith(record.instance.encode()) and kv.lease != 0

            request = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 120,
                       "ignore_eos": True, "stream": True, "temperature": 0,
                       "return_token_ids": True}  # fmt: skip
            tokens = 0
            events: list[str] = []
            async with (
                httpx.AsyncClient(timeout=60) as http,
                http.stream("POST", gen.url + "/v1/completions", json=request) as response,
                client.watch(prefix, start_revision=answer.revision + 1) as batches,
            ):
                lines = response.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        # A reader that fell behind gets its first tokens in one chunk.
                        tokens += len(json.loads(line[6:])["choices"][0]["token_ids"])
                        break
                gen.proc.send_signal(signal.SIGTERM)
                with trio.fail_after(5):
                    async for batch in batches:
                        events += [e.type.value for e in batch.events]
                        if EventType.DELETE.value in events:
                            break
                assert gen.alive(), "the key goes first; the worker still serves its stream"
                finish = None
                async for line in lines:
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        tokens += len(choice["token_ids"])
                        finish = choice.get("finish_reason") or finish
            assert events == ["DELETE"]
            assert finish == "length" and tokens == 120  # not cut short
        exit_code = await trio.to_thread.run_sync(gen.proc.wait, 30)
        assert exit_code == 0, gen.log()[-2000:]
        assert "drained in" in gen.log()
