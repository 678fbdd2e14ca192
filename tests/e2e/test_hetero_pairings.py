"""Heterogeneous ctx → gen pairings over real multi-rank instances, real ZMQ and real NIXL.

Each ctx instance and each gen instance cuts the same 4-layer GQA model its own way (TP, PP,
duplicated kv heads, HND or NHD). For every pairing the split answer must equal the aggregated
TP1 answer and HF's greedy tokens, and the KV that landed on gen must be byte-for-byte the KV ctx
computed: both sides digest every (layer, kv head) they hold, and rank 0 composes one digest that
does not depend on the cut (worker/engine/test_hooks.py).

The instances of one model start together and serve all its pairings; after each pairing every
instance is idle with all its blocks back.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import yaml

from tests.fault_checks import gen_asks_first, set_faults
from tests.instances import running_instances
from tests.oracle import assert_greedy_match, hf_greedy
from tests.procs import Server, children, free_port, metric, spawn
from trtdisagg.model.tiny import TinySpec, write_checkpoint

pytestmark = pytest.mark.slow

TRANSFER = {"backend": "NIXL", "kv_transfer_timeout_ms": 20000, "nixl_progress_thread": False}
HOOKS = {"TRTDISAGG_TEST_HOOKS": "1"}
BASE = TinySpec(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96)
MAX_TOKENS = 8
TOKENS_PER_BLOCK = 16


def _instance(
    role: str, model: Path, *, tp: int = 1, pp: int = 1, layout: str = "HND", bounce_mb: int = 0
) -> tuple[str, dict[str, Any]]:
    return role, {
        "model": str(model),
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        # Small steps: longer prompts prefill in chunks that share steps with decodes.
        "max_num_tokens": 48,
        "kv_cache_config": {
            "tokens_per_block": TOKENS_PER_BLOCK,
            "max_tokens": 4096,
            "layout": layout,
        },
        "cache_transceiver_config": {**TRANSFER, "kv_cache_bounce_size_mb": bounce_mb},
    }


@attrs.frozen
class Group:
    model: Path
    servers: dict[str, Server]


@contextlib.contextmanager
def _group(
    tmp: Path,
    name: str,
    spec: TinySpec,
    instances: dict[str, tuple[str, dict[str, Any]]],
    env: dict[str, str] = HOOKS,
) -> Iterator[Group]:
    model = tmp / name
    write_checkpoint(spec, model)
    specs = {key: _instance(role, model, **opts) for key, (role, opts) in instances.items()}
    with running_instances(tmp, specs, env=env) as servers:
        yield Group(model=model, servers=servers)


@pytest.fixture(scope="module")
def kv2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    instances = {
        "ctx_tp1": ("ctx", {}),
        "ctx_tp2": ("ctx", {"tp": 2}),
        "ctx_pp2": ("ctx", {"pp": 2}),
        "ctx_tp2pp2": ("ctx", {"tp": 2, "pp": 2}),
        "gen_tp1": ("gen", {}),
        "gen_tp2": ("gen", {"tp": 2}),
        "gen_pp2": ("gen", {"pp": 2}),
        "gen_tp2_nhd": ("gen", {"tp": 2, "layout": "NHD"}),
    }
    # Faults armed, with no rule until a test sets one (rank 0 of each instance).
    env = {**HOOKS, "TRTDISAGG_FAULTS": "none"}
    with _group(tmp_path_factory.mktemp("kv2"), "kv2", BASE, instances, env) as group:
        yield group


@pytest.fixture(scope="module")
def kv_other(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Group]]:
    """4 kv heads (one model) and 1 kv head (duplicated under TP2), started together. They are
    the other architectures too: Qwen3 (q and k normed per head) and Qwen2 (biased q, k, v,
    whose duplicated kv head duplicates its bias)."""
    tmp = tmp_path_factory.mktemp("kv_other")
    kv4 = attrs.evolve(BASE, num_kv_heads=4, arch="qwen3")
    kv1 = attrs.evolve(BASE, num_kv_heads=1, arch="qwen2")
    with (
        _group(
            tmp, "kv4", kv4, {"ctx_tp2": ("ctx", {"tp": 2}), "gen_pp2": ("gen", {"pp": 2})}
        ) as g4,
        _group(
            tmp,
            "kv1",
            kv1,
            {"ctx_tp2": ("ctx", {"tp": 2}), "gen_tp1": ("gen", {}), "gen_tp2": ("gen", {"tp": 2})},
        ) as g1,
    ):
        yield {"kv4": g4, "kv1": g1}


@pytest.fixture(scope="module")
def bounce(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    """The bounce path: 1 MiB staging buffers on every rank, so concurrent transfers queue."""
    instances = {
        "ctx_tp2": ("ctx", {"tp": 2, "bounce_mb": 1}),
        "gen_tp1_nhd": ("gen", {"layout": "NHD", "bounce_mb": 1}),
        "gen_pp2": ("gen", {"pp": 2, "bounce_mb": 1}),
    }
    with _group(tmp_path_factory.mktemp("bounce"), "kv2b", BASE, instances) as group:
        yield group


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Within one block, across a block boundary, and several blocks with a partial last one.
    return [[rng.randrange(10, 500) for _ in range(n)] for n in (9, 37, 70)]


def _body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip


async def _split(
    client: httpx.AsyncClient, ctx: Server, gen: Server, prompt: list[int]
) -> tuple[list[int], int]:
    ctx_body = _body(prompt, disaggregated_params={"request_type": "context_only"})
    r = await client.post(ctx.url + "/v1/completions", json=ctx_body)
    assert r.status_code == 200, r.text
    answer = r.json()
    params = dict(answer["choices"][0]["disaggregated_params"])
    params["request_type"] = "generation_only"
    gen_body = _body(
        prompt, prompt_token_ids=answer["prompt_token_ids"], disaggregated_params=params
    )
    g = await client.post(gen.url + "/v1/completions", json=gen_body)
    assert g.status_code == 200, g.text
    return list(g.json()["choices"][0]["token_ids"]), int(params["transfer_key"])


async def _wait_idle(client: httpx.AsyncClient, server: Server) -> None:
    with trio.fail_after(20):
        while True:
            text = (await client.get(server.url + "/metrics")).text
            free = metric(text, "trtdisagg_kv_cache_free_blocks")
            reusable = metric(text, "trtdisagg_kv_cache_reusable_blocks")
            total = metric(text, "trtdisagg_kv_cache_total_blocks")
            if metric(text, "trtdisagg_requests_running") == 0 and free + reusable == total > 0:
                return
            await trio.sleep(0.05)  # polling an observable condition, bounded above


async def _check_pairing(
    group: Group, ctx_name: str, gen_name: str, seed: int, *, bytes_per_token: int = 0
) -> None:
    """ctx's context-only answer handed to gen, as the coordinator hands it on: what varies
    between pairings is the KV's path from one cut to the other, and the coordinator's own path
    over such instances is tested on its own (test_coordinator_in_front_of_tp2_ctx_and_pp2_gen).

    With `bytes_per_token`, ctx's byte counter must grow by exactly the prompts' KV: every rank's
    writes counted once (rank 0 exports its followers' too), none twice."""
    ctx, gen = group.servers[ctx_name], group.servers[gen_name]
    async with httpx.AsyncClient(timeout=60) as client:
        sent_before = metric(
            (await client.get(ctx.url + "/metrics")).text, "trtdisagg_kv_transfer_bytes_total"
        )
        for prompt in _prompts(seed):
            before = set((await client.get(gen.url + "/debug/kv_digests")).json())
            tokens, key = await _split(client, ctx, gen, prompt)
            ref, margins = hf_greedy(group.model, prompt, MAX_TOKENS)
            assert_greedy_match(tokens, ref, margins)
            ctx_digests = (await client.get(ctx.url + "/debug/kv_digests")).json()
            gen_digests = (await client.get(gen.url + "/debug/kv_digests")).json()
            assert set(gen_digests) - before == {str(key)}  # this request's transfer only
            assert gen_digests[str(key)] == ctx_digests[str(key)], (
                f"{ctx_name} -> {gen_name}: gen KV differs from ctx KV for prompt of "
                f"{len(prompt)} tokens"
            )
            assert not ctx_digests[str(key)].startswith("mismatch")
        await _wait_idle(client, ctx)
        await _wait_idle(client, gen)
        if bytes_per_token:
            sent = metric(
                (await client.get(ctx.url + "/metrics")).text,
                "trtdisagg_kv_transfer_bytes_total",
            )
            lengths = [len(prompt) for prompt in _prompts(seed)]
            if not gen_name.endswith("_nhd"):
                # Same layout: a partial last block goes whole, one piece per run.
                lengths = [-(-n // TOKENS_PER_BLOCK) * TOKENS_PER_BLOCK for n in lengths]
            # (HND -> NHD moves token by token: only the prompt's own tokens.)
            want = bytes_per_token * sum(lengths)
            assert sent - sent_before == want, f"{ctx_name} counted {sent - sent_before}"


@pytest.mark.parametrize(
    ("ctx_name", "gen_name"),
    [
        ("ctx_tp1", "gen_tp2"),
        ("ctx_tp2", "gen_tp1"),
        ("ctx_tp2", "gen_pp2"),
        ("ctx_pp2", "gen_tp2"),
        ("ctx_tp2", "gen_tp2"),
        ("ctx_pp2", "gen_pp2"),
        ("ctx_pp2", "gen_tp2_nhd"),
        ("ctx_tp1", "gen_tp2_nhd"),
    ],
)
async def test_kv2_pairings(kv2: Group, ctx_name: str, gen_name: str) -> None:
    # Two kv heads over at most two TP ranks: no head is duplicated, so each byte moves once.
    head_dim = BASE.hidden_size // BASE.num_heads
    per_token = BASE.num_layers * 2 * BASE.num_kv_heads * head_dim * 4  # float32 K and V
    await _check_pairing(
        kv2, ctx_name, gen_name, seed=sum(map(ord, ctx_name + gen_name)), bytes_per_token=per_token
    )


async def test_split_equals_aggregated_tp1_exactly(kv2: Group) -> None:
    """Not only HF's tokens under the near-tie rule: exactly what TP1 serves aggregated."""
    async with httpx.AsyncClient(timeout=60) as client:
        for prompt in _prompts(7):
            r = await client.post(
                kv2.servers["ctx_tp1"].url + "/v1/completions", json=_body(prompt)
            )
            aggregated = r.json()["choices"][0]["token_ids"]
            for ctx_name, gen_name in (("ctx_tp2", "gen_pp2"), ("ctx_pp2", "gen_tp2")):
                tokens, _ = await _split(
                    client, kv2.servers[ctx_name], kv2.servers[gen_name], prompt
                )
                assert tokens == aggregated, f"{ctx_name} -> {gen_name}"


@pytest.mark.parametrize(
    ("model", "ctx_name", "gen_name"),
    [
        ("kv4", "ctx_tp2", "gen_pp2"),
        ("kv1", "ctx_tp2", "gen_tp1"),
        ("kv1", "ctx_tp2", "gen_tp2"),
    ],
)
async def test_other_kv_head_counts_and_architectures(
    kv_other: dict[str, Group], model: str, ctx_name: str, gen_name: str
) -> None:
    group = kv_other[model]
    await _check_pairing(group, ctx_name, gen_name, seed=len(model) + len(gen_name))
    # Not only HF's tokens under the near-tie rule: exactly what gen serves on its own.
    ctx, gen = group.servers[ctx_name], group.servers[gen_name]
    prompt = _prompts(5)[1]
    async with httpx.AsyncClient(timeout=60) as client:
        split, _ = await _split(client, ctx, gen, prompt)
        assert split == await _tokens(client, gen.url, _body(prompt))


@pytest.mark.parametrize("schedule", ["context_first", "generation_first"])
def test_coordinator_in_front_of_tp2_ctx_and_pp2_gen(
    kv2: Group, tmp_path: Path, schedule: str
) -> None:
    """The user's path: the OpenAI client through the coordinator, ctx TP2 → gen PP2. With
    generation_first, each gen rank asks before ctx answered and the first token comes with
    the KV."""
    import openai

    port = free_port()
    config = {
        "hostname": "127.0.0.1",
        "port": port,
        "context_servers": {"urls": [kv2.servers["ctx_tp2"].url]},
        "generation_servers": {"urls": [kv2.servers["gen_pp2"].url]},
        "health_check_interval": 0.2,
        "server_start_timeout": 60,
        "schedule_style": schedule,
    }
    path = tmp_path / "disagg.yaml"
    path.write_text(yaml.safe_dump(config))
    prompt = _prompts(11)[2]
    aggregated = httpx.post(
        kv2.servers["ctx_tp1"].url + "/v1/completions", json=_body(prompt), timeout=60
    ).json()["choices"][0]["text"]
    with spawn(["coordinator", "--config", str(path)], port=port, log_path=tmp_path / "c.log") as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused")
        answer = client.completions.create(
            model=kv2.model.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert answer.choices[0].text == aggregated
        stream = client.completions.create(
            model=kv2.model.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == aggregated


async def test_a_tp2_ctx_frees_kv_released_before_any_gen_asked(kv2: Group) -> None:
    """`/disagg/release` (the coordinator's call when no gen leg took the KV): every rank of a
    multi-rank ctx stops holding it, long before the 20 s transfer deadline."""
    ctx = kv2.servers["ctx_tp2"]
    key = 2**44 + 77
    params = {"request_type": "context_only", "disagg_request_id": key}
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(
            ctx.url + "/v1/completions", json=_body(_prompts(13)[2], disaggregated_params=params)
        )
        assert r.status_code == 200, r.text
        text = (await client.get(ctx.url + "/metrics")).text
        free = metric(text, "trtdisagg_kv_cache_free_blocks")
        free += metric(text, "trtdisagg_kv_cache_reusable_blocks")
        assert free < metric(text, "trtdisagg_kv_cache_total_blocks")  # held for a gen
        asked = time.monotonic()
        r = await client.post(ctx.url + "/disagg/release", json={"disagg_request_id": key})
        assert r.status_code == 200 and r.json()["released"] is True, r.text
        await _wait_idle(client, ctx)
        assert time.monotonic() - asked < TRANSFER["kv_transfer_timeout_ms"] / 4000
        r = await client.post(ctx.url + "/disagg/release", json={"disagg_request_id": key})
        assert r.json()["released"] is False  # nothing held any more
        assert _counter(ctx, "trtdisagg_kv_sends_released_total") >= 1


def _counter(server: Server, name: str) -> float:
    return metric(httpx.get(server.url + "/metrics").text, name)


@pytest.mark.parametrize(("gen_name", "gen_ranks"), [("gen_tp1_nhd", 1), ("gen_pp2", 2)])
async def test_bounce_path_lands_exact_bytes_in_few_descriptors(
    bounce: Group, gen_name: str, gen_ranks: int
) -> None:
    ctx = bounce.servers["ctx_tp2"]
    before = _counter(ctx, "trtdisagg_kv_bounce_transfers_total")
    descriptors = _counter(ctx, "trtdisagg_kv_transfer_descriptors_total")
    await _check_pairing(bounce, "ctx_tp2", gen_name, seed=len(gen_name))
    # Every write of this pairing bounced (each ctx rank writes once per prompt to each gen
    # rank; the bounce counter is rank 0's own), each in at most one descriptor per layer and
    # K/V; direct writes would take one per token and head (transposed) or per head range and
    # block. The descriptor counter adds up both ctx ranks' writes.
    bounced = _counter(ctx, "trtdisagg_kv_bounce_transfers_total") - before
    assert bounced == 3 * gen_ranks
    ctx_ranks = 2
    written = _counter(ctx, "trtdisagg_kv_transfer_descriptors_total") - descriptors
    assert written <= bounced * ctx_ranks * 8
    assert _counter(bounce.servers[gen_name], "trtdisagg_kv_bounce_transfers_total") >= 3


async def test_bounce_buffer_full_transfers_wait_and_all_land(bounce: Group) -> None:
    """32 concurrent transfers need about 2.3 MiB of staging; 1 MiB holds 14: the rest wait."""
    ctx, gen = bounce.servers["ctx_tp2"], bounce.servers["gen_tp1_nhd"]
    rng = random.Random(99)
    prompts = [[rng.randrange(10, 500) for _ in range(70)] for _ in range(32)]
    keys: list[int] = [0] * len(prompts)
    async with httpx.AsyncClient(timeout=60) as client:
        reference = [
            (await client.post(ctx.url + "/v1/completions", json=_body(p))).json()["choices"][0][
                "token_ids"
            ]
            for p in prompts
        ]

        async def one(i: int) -> None:
            tokens, keys[i] = await _split(client, ctx, gen, prompts[i])
            assert tokens == reference[i], f"request {i}"

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        ctx_digests = (await client.get(ctx.url + "/debug/kv_digests")).json()
        gen_digests = (await client.get(gen.url + "/debug/kv_digests")).json()
        for key in keys:
            assert gen_digests[str(key)] == ctx_digests[str(key)]
        await _wait_idle(client, ctx)
        await _wait_idle(client, gen)


async def _tokens(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[int]:
    r = await client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


async def test_parallel_workers_serve_tp1_tokens_concurrently(kv2: Group) -> None:
    """Worker parallelism on its own (gloo, CPU): TP2, PP2 and TP2 x PP2 instances serve the
    TP1 tokens (and TP1 HF's) for a concurrent mix of prompt lengths, chunked prefill included."""
    rng = random.Random(3)
    bodies = [
        {**_body([rng.randrange(10, 500) for _ in range(rng.randint(1, 90))]),
         "max_tokens": rng.randint(1, 12)}
        for _ in range(24)
    ]  # fmt: skip
    async with httpx.AsyncClient(timeout=120) as client:
        tp1 = kv2.servers["ctx_tp1"].url
        reference = [await _tokens(client, tp1, b) for b in bodies]
        for name in ("ctx_tp2", "ctx_pp2", "ctx_tp2pp2"):
            got: list[list[int]] = [[] for _ in bodies]

            async def one(
                i: int, url: str = kv2.servers[name].url, got: list[list[int]] = got
            ) -> None:
                got[i] = await _tokens(client, url, bodies[i])

            async with trio.open_nursery() as nursery:
                for i in range(len(bodies)):
                    nursery.start_soon(one, i)
            for i, (ref, mine) in enumerate(zip(reference, got, strict=True)):
                assert mine == ref, f"{name}, request {i}: {mine} vs TP1 {ref}"
            await _wait_idle(client, kv2.servers[name])
    for body, ref in list(zip(bodies, reference))[:4]:
        hf, margins = hf_greedy(kv2.model, body["prompt"], body["max_tokens"])
        assert_greedy_match(ref, hf, margins)


def _followers(rank0: subprocess.Popen[bytes]) -> list[int]:
    """The pids of an instance's follower ranks: rank 0's spawned children (not the resource
    tracker that `spawn` may start beside them)."""
    found = []
    for pid in children(rank0.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # it ended meanwhile
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found.append(pid)
    return found


async def test_one_rank_of_a_tp2_ctx_dying_fails_the_waiting_gen_at_once(bounce: Group) -> None:
    """gen asked a TP2 ctx first (generation-first), then ctx's second rank dies alone
    (SIGKILL), its first rank alive. gen's control link to the dead rank stays down, so the
    whole instance is gone for gen: the request fails at once (not at its 20 s deadline) and
    frees its blocks, and gen goes on serving; the ctx instance stops, as it cannot serve
    without a rank (peers.md, pain point 3). The last test of `bounce`: its ctx does not come
    back."""
    ctx, gen = bounce.servers["ctx_tp2"], bounce.servers["gen_tp1_nhd"]
    key = 2**50 + 3303
    prompt = [random.Random(33).randrange(10, 500) for _ in range(40)]
    gen_body = _body(prompt, disaggregated_params={
        "request_type": "generation_only", "schedule_style": "generation_first",
        "disagg_request_id": key, "ctx_request_id": key,
    })  # fmt: skip
    (follower,) = _followers(ctx.proc)
    async with httpx.AsyncClient(timeout=60) as client:
        info = (await client.get(ctx.url + "/server_info")).json()
        gen_body["disaggregated_params"]["ctx_info_endpoint"] = info["disaggregated_params"][
            "ctx_info_endpoint"
        ]
        async with trio.open_nursery() as nursery:
            refused = await gen_asks_first(client, nursery, gen, ctx, gen_body)
            killed = time.monotonic()
            os.kill(follower, signal.SIGKILL)
        elapsed = time.monotonic() - killed
        (g,) = refused
        assert g.status_code == 502, g.text
        assert "is gone" in g.json()["error"]["message"], g.text
        assert elapsed < TRANSFER["kv_transfer_timeout_ms"] / 1000 / 2, elapsed
        await _wait_idle(client, gen)
        assert await _tokens(client, gen.url, _body(prompt)) != []  # gen serves on
    # The instance stops on its own.
    assert await trio.to_thread.run_sync(ctx.proc.wait, 15) != 0
    assert "rank 1" in ctx.log() and "stopping the instance" in ctx.log()


async def test_a_ctx_rank_dying_after_its_peer_rank_wrote_fails_gen_without_decoding(
    kv2: Group,
) -> None:
    """Pain point 3, between two ranks' writes: a TP2 ctx's follower has written its half of a
    request's KV into gen, and rank 0 dies with its own half held back (a stalled write). gen
    must not decode from half the KV: its request fails at once (not at the 20 s deadline) and
    frees its blocks, and gen serves on. The last test of `kv2`: its ctx_tp2 does not come back."""
    ctx, gen = kv2.servers["ctx_tp2"], kv2.servers["gen_tp1"]
    prompt = [random.Random(3).randrange(10, 500) for _ in range(40)]
    stalled = 'action="stall_transfer",message=""'
    async with httpx.AsyncClient(timeout=60) as client:
        before = (await client.get(ctx.url + "/metrics")).text
        moved = metric(before, "trtdisagg_kv_transfer_bytes_total")
        await set_faults(client, ctx, "stall_transfer:60s:1")  # rank 0's next write
        r = await client.post(ctx.url + "/v1/completions", json=_body(
            prompt, disaggregated_params={"request_type": "context_only"}))  # fmt: skip
        assert r.status_code == 200, r.text
        answer = r.json()
        params = {**answer["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
        gen_body = _body(
            prompt, prompt_token_ids=answer["prompt_token_ids"], disaggregated_params=params
        )
        answers: list[httpx.Response] = []
        async with trio.open_nursery() as nursery:

            async def ask() -> None:
                answers.append(await client.post(gen.url + "/v1/completions", json=gen_body))

            nursery.start_soon(ask)
            with trio.fail_after(20):  # the follower's write ended, rank 0's is held back
                while True:
                    text = (await client.get(ctx.url + "/metrics")).text
                    if (
                        metric(text, "trtdisagg_faults_injected_total", stalled) == 1
                        and metric(text, "trtdisagg_kv_transfer_bytes_total") > moved
                    ):
                        break  # fmt: skip
                    await trio.sleep(0.05)  # polling ctx's metrics, bounded above
            killed = time.monotonic()
            ctx.proc.send_signal(signal.SIGKILL)
        elapsed = time.monotonic() - killed
        (g,) = answers
        assert g.status_code == 502, g.text
        assert elapsed < TRANSFER["kv_transfer_timeout_ms"] / 1000 / 2, elapsed
        await _wait_idle(client, gen)
        assert await _tokens(client, gen.url, _body(prompt)) != []  # gen serves on
