"""PeerLiveness: which peer instances are gone (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from trtdisagg.transfer.liveness import PeerLiveness


def _watch() -> PeerLiveness:
    watch = PeerLiveness(idle_s=5.0, answer_s=2.0, misses=3)
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
    assert watch.gone(11.5) == [] and "gen-a" in watch


def test_a_peer_that_misses_every_probe_is_gone_after_the_last_one() -> None:
    watch = _watch()
    assert watch.to_probe(5.0) == [("gen-a", "tcp://h:1")]  # probe 1
    assert watch.to_probe(7.0) == [("gen-a", "tcp://h:1")]  # 1 missed: probe 2
    assert watch.gone(8.9) == []
    assert watch.to_probe(9.0) == [("gen-a", "tcp://h:1")]  # 2 missed: probe 3
    assert watch.gone(10.9) == []
    assert watch.gone(11.0) == ["gen-a"]  # the third went unanswered
    assert watch.to_probe(11.0) == []  # no fourth probe
    watch.forget("gen-a")
    assert "gen-a" not in watch and watch.gone(20.0) == []


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
    assert watch.gone(1.0) == ["gen-a"]
    assert watch.to_probe(10.0) == [("gen-b", "tcp://h:2")]  # not the replaced one
    watch.heard("gen-a", 2.0)  # a late message from the old instance does not revive it
    assert watch.gone(2.0) == ["gen-a"]


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
