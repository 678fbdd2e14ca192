"""What a ctx worker tells gen about itself in `disaggregated_params.opaque_state` (pure).

A control endpoint alone does not name a ctx instance: a ctx restarted on a reused port would be
taken for its old self, whose registration of gen died with it, and every transfer would time
out. So ctx puts its instance name (new on every start) in the opaque state of its answer; the
coordinator passes it on untouched, and gen rendezvous again when the name it has cached for that
endpoint differs. A client that builds a generation_only request by hand may leave it out:
gen then trusts its cache, as before.
"""

from __future__ import annotations

PREFIX = "trtdisagg-ctx:"


def ctx_state(instance_name: str) -> str:
    """The opaque state ctx sends: its instance name, tagged."""
    return PREFIX + instance_name


def ctx_instance_of(state: str | None) -> str | None:
    """The ctx instance name in `state`, or None when it holds none (absent or foreign)."""
    if state is None or not state.startswith(PREFIX) or len(state) == len(PREFIX):
        return None
    return state[len(PREFIX) :]
