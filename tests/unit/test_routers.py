"""Routers: choices, reservations, exclude, pairing, KV-aware scoring, conversation stickiness."""

from __future__ import annotations

import attrs
import pytest

from trtdisagg.coordinator.config import RouterConfig, RouterType
from trtdisagg.coordinator.routers import (
    ConversationRouter,
    KvCacheAwareRouter,
    KvEvent,
    LoadBalancingRouter,
    NoServerAvailable,
    Pairing,
    RoundRobinRouter,
    Router,
    RouteRequest,
    ServerView,
    create_router,
    parse_kv_events,
)
from trtdisagg.coordinator.routers.conversation import rendezvous_choice
from trtdisagg.kv.hashing import reusable_block_hashes

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def servers(*urls: str, tokens_per_block: int = 4, max_batch_size: int = 8) -> list[ServerView]:
    return [
        ServerView(url=u, tokens_per_block=tokens_per_block, max_batch_size=max_batch_size)
        for u in urls
    ]


def make(kind: type[Router], *urls: str, **config: object) -> Router:
    router = kind(RouterConfig(**config), role="context")  # type: ignore[arg-type]
    router.update_servers(servers(*urls))
    return router


def req(key: int, tokens: list[int] | None = None, **kw: object) -> RouteRequest:
    return RouteRequest(key=key, prompt_token_ids=tuple(tokens) if tokens else None, **kw)  # type: ignore[arg-type]


def test_create_router_by_type() -> None:
    for kind, cls in [
        (RouterType.ROUND_ROBIN, RoundRobinRouter),
        (RouterType.LOAD_BALANCING, LoadBalancingRouter),
        (RouterType.KV_CACHE_AWARE, KvCacheAwareRouter),
        (RouterType.CONVERSATION, ConversationRouter),
    ]:
        assert type(create_router(RouterConfig(type=kind), role="generation")) is cls


def test_round_robin_alternates_and_honours_exclude() -> None:
    router = make(RoundRobinRouter, A, B, C)
    picks = [router.select(req(i)).server for i in range(6)]
    assert picks == [A, B, C, A, B, C]
    assert all(router.select(req(10 + i), exclude=B).server != B for i in range(6))


def test_no_servers_and_only_excluded_server() -> None:
    router = make(RoundRobinRouter)
    with pytest.raises(NoServerAvailable, match="no context servers available"):
        router.select(req(1))
    router.update_servers(servers(A))
    with pytest.raises(NoServerAvailable, match=f"after excluding {A}"):
        router.select(req(1), exclude=A)


@pytest.mark.parametrize(
    "kind", [RoundRobinRouter, LoadBalancingRouter, KvCacheAwareRouter, ConversationRouter]
)
def test_a_server_that_cannot_pair_is_never_chosen_however_it_scores(kind: type[Router]) -> None:
    router = make(kind, A, B, C)
    prompt = list(range(1, 18))
    conversation = _ranked_first(A, [A, B, C])  # A holds the conversation ...
    router.apply_kv_events(A, _stored(reusable_block_hashes(prompt, 4)))  # ... and the prefix
    router.select(req(1, prompt, conversation_id=conversation))
    router.finish(1)
    if kind in (KvCacheAwareRouter, ConversationRouter):
        assert router.select(req(2, prompt, conversation_id=conversation)).server == A  # A wins
        router.finish(2)
    pairing = Pairing(peer="http://ctx:1", incompatible={A: "tokens_per_block: ctx 16 vs gen 32"})
    for i in range(6):
        chosen = router.select(req(3 + i, prompt, conversation_id=conversation), pairing=pairing)
        assert chosen.server != A
    nowhere = Pairing(peer="http://ctx:1", incompatible=dict.fromkeys([A, B, C], "x"))
    with pytest.raises(NoServerAvailable, match=r"^no context server can exchange KV with"):
        router.select(req(9), pairing=nowhere)


def test_round_robin_stays_fair_when_the_candidates_change() -> None:
    """Two groups taking turns: {A, B} pair with one ctx and {C} with another. A and B each
    get half of their group's requests (a counter over the candidates gave A all of them)."""
    router = make(RoundRobinRouter, A, B, C)
    first = Pairing(peer="http://ctx-1:1", incompatible={C: "-"})
    second = Pairing(peer="http://ctx-2:1", incompatible={A: "-", B: "-"})
    picks = [router.select(req(i), pairing=(first, second)[i % 2]).server for i in range(8)]
    assert picks == [A, C, B, C, A, C, B, C]


def test_reservations_release_exactly_once() -> None:
    router = make(LoadBalancingRouter, A, B)
    sel = router.select(req(1))
    assert router.active_requests(sel.server) == 1
    assert router.finish(1) == sel.server
    assert router.finish(1) is None  # second finish is a no-op
    assert router.active_requests(sel.server) == 0
    assert router.finish(999) is None


def test_reselect_same_key_releases_previous_reservation() -> None:
    router = make(LoadBalancingRouter, A, B)
    router.select(req(1))
    router.select(req(1))
    stats = router.statistics()
    assert sum(stats.active_requests.values()) == 1


def test_load_balancing_by_requests() -> None:
    router = make(LoadBalancingRouter, A, B)
    first = router.select(req(1)).server
    second = router.select(req(2)).server
    assert {first, second} == {A, B}
    router.finish(1)
    assert router.select(req(3)).server == first  # the one with no load


def test_load_balancing_by_tokens() -> None:
    router = make(LoadBalancingRouter, A, B, use_tokens=True)
    big = router.select(req(1, list(range(100)))).server
    small = [router.select(req(2 + i, [1, 2])).server for i in range(5)]
    assert all(s != big for s in small)  # 5 small prompts still weigh less than the big one
    assert router.uses_prompt_tokens


def test_load_balancing_ties_go_round_robin() -> None:
    router = make(LoadBalancingRouter, A, B, C)
    picks = []
    for i in range(6):
        picks.append(router.select(req(i)).server)
        router.finish(i)
    assert picks == [A, B, C, A, B, C]


def _stored(hashes: list[int], event_id: int = 0) -> list[KvEvent]:
    return [KvEvent(event_id=event_id, kind="stored", block_hashes=tuple(hashes))]


def test_kv_aware_prefers_cached_prefix() -> None:
    router = make(KvCacheAwareRouter, A, B)
    prompt = list(range(1, 18))  # 17 tokens: 4 reusable blocks of 4 (the last token is excluded)
    router.apply_kv_events(B, _stored(reusable_block_hashes(prompt, 4)[:3]))
    sel = router.select(req(1, prompt))
    assert sel.server == B
    assert sel.matched_tokens == 12


def test_kv_aware_matches_a_salted_prompt_only_against_its_salt() -> None:
    """vLLM's cache_salt: a server holding a prompt under one salt is no hit for the same prompt
    unsalted or under another salt, and is one under the same salt."""
    router = make(KvCacheAwareRouter, A, B)
    prompt = list(range(1, 18))
    router.apply_kv_events(B, _stored(reusable_block_hashes(prompt, 4, salt="t1")))
    salted = attrs.evolve(req(1, prompt), cache_salt="t1")
    assert (router.select(salted).server, router.select(salted).matched_tokens) == (B, 16)
    for i, other in enumerate((None, "t2")):
        sel = router.select(attrs.evolve(req(10 + i, prompt), cache_salt=other))
        assert sel.matched_tokens == 0


def test_kv_aware_matching_stops_at_first_miss() -> None:
    router = make(KvCacheAwareRouter, A, B)
    prompt = list(range(1, 18))
    hashes = reusable_block_hashes(prompt, 4)
    router.apply_kv_events(A, _stored([hashes[0], hashes[2], hashes[3]]))
    router.apply_kv_events(B, _stored(hashes[:2]))
    sel = router.select(req(1, prompt))
    assert (sel.server, sel.matched_tokens) == (B, 8)


def test_kv_aware_score_subtracts_load() -> None:
    router = make(KvCacheAwareRouter, A, B, max_batch_size=2)
    prompt = list(range(1, 10))  # 9 tokens, padded to 12; 2 reusable blocks
    router.apply_kv_events(A, _stored(reusable_block_hashes(prompt, 4)[:1]))
    # A: 4/12 - load/2. Loading A with one request makes it 4/12 - 1/2 < 0 = B's score.
    assert router.select(req(1, prompt)).server == A
    assert router.select(req(2, prompt)).server == B


def test_kv_aware_removed_events_and_reset() -> None:
    router = make(KvCacheAwareRouter, A, B)
    prompt = list(range(1, 10))
    hashes = reusable_block_hashes(prompt, 4)
    router.apply_kv_events(A, _stored(hashes))
    router.apply_kv_events(A, [KvEvent(event_id=1, kind="removed", block_hashes=(hashes[0],))])
    assert router.select(req(1, prompt)).matched_tokens == 0
    router.finish(1)
    router.apply_kv_events(B, _stored(hashes))
    router.reset_server(B)
    assert router.select(req(2, prompt)).matched_tokens == 0


def test_kv_aware_without_tokens_is_least_loaded_round_robin() -> None:
    router = make(KvCacheAwareRouter, A, B)
    assert [router.select(req(i)).server for i in range(4)] == [A, B, A, B]


def test_kv_aware_honours_exclude() -> None:
    router = make(KvCacheAwareRouter, A, B)
    prompt = list(range(1, 18))
    router.apply_kv_events(A, _stored(reusable_block_hashes(prompt, 4)))
    assert router.select(req(1, prompt), exclude=A).server == B


def test_conversation_sticky_id() -> None:
    router = make(ConversationRouter, A, B, C)
    first = router.select(req(1, conversation_id="chat-1")).server
    for i in range(5):
        router.select(req(10 + i))  # other traffic moves the round robin on
        assert router.select(req(20 + i, conversation_id="chat-1")).server == first


def test_conversation_sticky_server_gone_or_excluded() -> None:
    router = make(ConversationRouter, A, B)
    first = router.select(req(1, conversation_id="c")).server
    assert router.select(req(2, conversation_id="c"), exclude=first).server != first
    router.update_servers([s for s in servers(A, B) if s.url != first])
    assert router.select(req(3, conversation_id="c")).server != first


def test_conversation_implicit_prefix_match() -> None:
    router = make(ConversationRouter, A, B, tokens_per_block=4, match_threshold=0.5)
    history = list(range(1, 33))
    home = router.select(req(1, history)).server
    router.select(req(2, [99] * 32))  # unrelated prompt goes to the other server
    router.finish(1)
    router.finish(2)
    follow_up = [*history, 40, 41, 42, 43]
    assert router.select(req(3, follow_up)).server == home


def test_conversation_text_mode() -> None:
    router = make(ConversationRouter, A, B, tokens_per_block=2, match_threshold=0.5)
    text = "You are a helpful assistant. " * 4
    home = router.select(RouteRequest(key=1, prompt_text=text)).server
    router.finish(1)
    assert router.select(RouteRequest(key=2, prompt_text=text + "More?")).server == home


def test_conversation_prefix_map_is_bounded() -> None:
    router = make(ConversationRouter, A, B, tokens_per_block=4, max_sessions=2)
    for i in range(5):
        router.select(req(i, [10 * i + t for t in range(1, 9)]))  # two blocks each
    assert isinstance(router, ConversationRouter)
    assert len(router._prefixes) == 2


def _ranked_first(url: str, urls: list[str]) -> str:
    """A conversation id that rendezvous hashing places on `url` among `urls`."""
    return next(c for c in (f"chat-{i}" for i in range(1000)) if rendezvous_choice(c, urls) == url)


def test_front_ends_with_different_histories_place_a_conversation_alike() -> None:
    """Two front ends of a fleet share no state, and each has seen other traffic: every turn of
    a conversation still reaches one server, whichever front end it lands on."""
    first, second = make(ConversationRouter, A, B, C), make(ConversationRouter, A, B, C)
    for i in range(5):  # load and round-robin turns that only the second front end has seen
        second.select(req(100 + i, [7] * 8))
    for n in range(30):
        conversation = f"conversation-{n}"
        home = first.select(req(1000 + n, conversation_id=conversation)).server
        for turn in range(3):
            key = 2000 + 10 * n + turn
            assert second.select(req(key, conversation_id=conversation)).server == home
            assert first.select(req(key, conversation_id=conversation)).server == home
        # a retry that excludes the home server goes to the same fallback on both
        fallback = first.select(req(3000 + n, conversation_id=conversation), exclude=home).server
        again = second.select(req(3000 + n, conversation_id=conversation), exclude=home).server
        assert fallback == again != home


def test_conversations_spread_evenly_and_a_joining_server_takes_only_its_share() -> None:
    router = make(ConversationRouter, A, B, C)
    ids = [f"c{i}" for i in range(600)]
    before = {c: router.select(req(i, conversation_id=c)).server for i, c in enumerate(ids)}
    for server in (A, B, C):
        assert 150 <= list(before.values()).count(server) <= 250, server
    D = "http://d:1"
    router.update_servers(servers(A, B, C, D))
    after = {c: router.select(req(10_000 + i, conversation_id=c)).server for i, c in enumerate(ids)}
    moved = [c for c in ids if after[c] != before[c]]
    assert all(after[c] == D for c in moved)  # nobody moves between the servers that stayed
    assert 100 <= len(moved) <= 200  # about a quarter


def test_parse_kv_events() -> None:
    events = parse_kv_events(
        [
            {"event_id": 3, "kind": "stored", "block_hashes": [1, 2], "parent_hash": None},
            {"event_id": 4, "kind": "removed", "block_hashes": [1], "parent_hash": 7},
        ]
    )
    assert [e.kind for e in events] == ["stored", "removed"]
    with pytest.raises(ValueError, match=r"\[0\].kind"):
        parse_kv_events([{"event_id": 1, "kind": "created", "block_hashes": []}])
    with pytest.raises(ValueError, match="expected a list"):
        parse_kv_events({"events": []})
