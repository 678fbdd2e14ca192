from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from trtdisagg.worker.http.handoff import ctx_instance_of, ctx_state


@given(st.text(min_size=1))
def test_the_instance_name_round_trips(name: str) -> None:
    assert ctx_instance_of(ctx_state(name)) == name


def test_foreign_or_empty_states_name_no_instance() -> None:
    # A hand-built generation_only request may carry anything here, or nothing.
    for state in (None, "", "trtdisagg-ctx:", "some other system's state", "ctx-abc"):
        assert ctx_instance_of(state) is None
