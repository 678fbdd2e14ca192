"""PeerLiveness: which peer instances are gone (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from trtdisagg.transfer.protocol.liveness import Gone, PeerLiveness


def _watch() -> PeerLiveness:
    watch = PeerLiveness(idle_s=5.0, answer_s=2.0, misses=3, relink_s=1.0)
    watch.track("gen-a", "tcp://h:1", now=0.0)
    return watch


def test_a_peer_heard_from_is_never_probed() -> None:
    watch = _watch()
    for t in range(1, 60):
        watch.heard("gen-a", float(t))
        assert watch.to_probe(float(t)) == []
        assert watch.gone(float(t)) == []


def test_a_silent_peer_is_probed_and_an_answer_keeps_it() -> None:
    watch = _watch()
    assert watch.to_probe(4.9) == []
    assert watch.to_probe(5.0) == [("gen-a", "tcp://h:1")]
    assert watch.to_probe(6.0) == []  # one probe at a time
    watch.answered("tcp://h:1", "gen-a", now=6.5)
    assert watch.gone(9.0) == []
    assert watch.to_probe(11.4) == []  # heard at 6.5
    assert watch.to_probe(11.5) == [("gen-a", "tcp://h:1")]
    assert watch.gone(11.5) == [] and len(watch) == 1


def test_a_peer_that_misses_every_probe_is_gone_after_the_last_one() -> None:
    watch = _watch()
    assert watch.to_probe(5.0) == [("gen-a", "tcp://h:1")]  # probe 1
    assert watch.to_probe(7.0) == [("gen-a", "tcp://h:1")]  # 1 missed: probe 2
    assert watch.gone(8.9) == []
    assert watch.to_probe(9.0) == [("gen-a", "tcp://h:1")]  # 2 missed: probe 3
    assert watch.gone(10.9) == []
    assert watch.gone(11.0) == [Gone("gen-a", False, "3 probes in a row went unanswered")]
    assert watch.to_probe(11.0) == []  # no fourth probe
    watch.forget("gen-a")
    assert len(watch) == 0 and watch.gone(20.0) == []


def test_any_message_resets_the_misses() -> None:
    watch = _watch()
    watch.to_probe(5.0)
    watch.to_probe(7.0)
    watch.heard("gen-a", 8.0)  # a REQUEST_DATA, say
    assert watch.to_probe(9.0) == []
    assert watch.gone(12.0) == []
    assert watch.to_probe(13.0) == [("gen-a", "tcp://h:1")]  # silent for 5 s again


def test_another_instance_answering_at_the_endpoint_replaces_the_old_one() -> None:
    watch = _watch()
    watch.track("gen-b", "tcp://h:2", now=0.0)
    watch.answered("tcp://h:1", "gen-c", now=1.0)  # a restart on the same port
    assert watch.gone(1.0) == [Gone("gen-a", True, "a new instance answers at its endpoint")]
    assert watch.to_probe(10.0) == [("gen-b", "tcp://h:2")]  # not the replaced one
    watch.heard("gen-a", 2.0)  # a late message from the old instance does not revive it
    assert [gone.instance for gone in watch.gone(2.0)] == ["gen-a"]


def test_untracked_names_and_endpoints_change_nothing() -> None:
    watch = _watch()
    watch.heard("nobody", 1.0)
    watch.answered("tcp://elsewhere:9", "gen-z", now=1.0)
    assert len(watch) == 1 and watch.gone(1.0) == []


@given(st.lists(st.tuples(st.sampled_from(["probe", "hear", "answer"]), st.floats(0, 3))))
def test_a_peer_that_keeps_answering_is_never_gone(events: list[tuple[str, float]]) -> None:
    watch = _watch()
    now = 0.0
    for kind, step in events:
        now += step
        if kind == "probe":
            for _name, endpoint in watch.to_probe(now):
                watch.answered(endpoint, "gen-a", now)  # answered at once
        elif kind == "hear":
            watch.heard("gen-a", now)
        else:
            watch.answered("tcp://h:1", "gen-a", now)
        assert watch.gone(now) == []


def test_a_connection_that_drops_and_stays_down_means_the_process_ended() -> None:
    watch = _watch()
    watch.track("gen-a", "tcp://h:7", now=0.0, rank0=False)  # its rank 1
    watch.link("tcp://h:7", up=False, now=3.0)
    watch.heard("gen-a", 3.5)  # rank 0 still talks: rank 1 ended all the same
    assert watch.gone(3.9) == []
    (gone,) = watch.gone(4.0)
    assert gone.instance == "gen-a" and gone.dead
    assert "tcp://h:7 dropped" in gone.reason


def test_a_connection_back_in_time_is_a_blip_and_the_peer_is_probed_at_once() -> None:
    watch = _watch()
    watch.link("tcp://h:1", up=False, now=3.0)
    watch.link("tcp://h:1", up=False, now=3.5)  # still the first drop that counts
    watch.link("tcp://h:1", up=True, now=3.8)
    assert watch.gone(10.0) == []
    assert watch.to_probe(3.8) == [("gen-a", "tcp://h:1")]  # maybe a new process: ask it
    watch.answered("tcp://h:1", "gen-b", now=3.9)  # it was: the old one is dead
    assert watch.gone(3.9) == [Gone("gen-a", True, "a new instance answers at its endpoint")]


def test_links_of_untracked_or_forgotten_instances_change_nothing() -> None:
    watch = _watch()
    watch.link("tcp://elsewhere:9", up=False, now=0.0)
    watch.forget("gen-a")
    watch.link("tcp://h:1", up=False, now=0.0)
    watch.track("gen-a", "tcp://h:2", now=1.0)  # back under the same name, elsewhere
    assert watch.gone(9.0) == []


@given(st.lists(st.tuples(st.floats(0, 0.99), st.floats(0, 5)), max_size=30))
def test_a_peer_whose_links_come_back_within_relink_s_is_never_dead(
    outages: list[tuple[float, float]],
) -> None:
    watch = _watch()
    now = 0.0
    for down_for, up_for in outages:
        watch.link("tcp://h:1", up=False, now=now)
        now += down_for
        assert watch.gone(now) == []
        watch.link("tcp://h:1", up=True, now=now)
        now += up_for
        assert watch.gone(now) == []
