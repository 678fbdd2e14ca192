"""What a ctx worker tells gen in `disaggregated_params` beyond ids (pure): its instance in
`opaque_state`, and its first tokens' logprobs by id.

A control endpoint alone does not name a ctx instance: a ctx restarted on a reused port would be
taken for its old self, whose registration of gen died with it, and every transfer would time
out. So ctx puts its instance name (new on every start) in the opaque state of its answer; the
coordinator passes it on untouched, and gen rendezvous again when the name it has cached for that
endpoint differs. A client that builds a generation_only request by hand may leave it out:
gen then trusts its cache, as before.
"""

from __future__ import annotations

import math
from typing import Any

from trtdisagg.worker.token_logprobs import TokenLogprobs

PREFIX = "trtdisagg-ctx:"


def ctx_state(instance_name: str) -> str:
    """The opaque state ctx sends: its instance name, tagged."""
    return PREFIX + instance_name


def ctx_instance_of(state: str | None) -> str | None:
    """The ctx instance name in `state`, or None when it holds none (absent or foreign)."""
    if state is None or not state.startswith(PREFIX) or len(state) == len(PREFIX):
        return None
    return state[len(PREFIX) :]


def first_token_logprobs(token: int, logprobs: TokenLogprobs) -> dict[str, Any]:
    """A token's logprobs as `disaggregated_params` carries them (`first_gen_logprobs`,
    `prompt_logprobs`), by id."""
    entry: dict[str, Any] = {
        "token_id": token,
        "logprob": _finite(logprobs.logprob),
        "top_logprobs": [{"token_id": t, "logprob": _finite(v)} for t, v in logprobs.top],
    }
    if logprobs.rank is not None:
        entry["rank"] = logprobs.rank
    return entry


def _finite(value: float) -> float:
    # -inf (a token masked out) is not JSON; the lowest float is as good for every use here.
    return value if math.isfinite(value) else -3.4e38
