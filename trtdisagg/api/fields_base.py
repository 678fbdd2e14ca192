"""A request field's rule: how the field acts here, or the 400 it gets. Pure.

The rules themselves are in `fields.py`, `vllm_fields.py` and `responses_fields.py`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs


class Support(enum.Enum):
    SUPPORTED = "supported"
    PARTIAL = "partial"  # some values act; the others get a 400 naming the field
    NEUTRAL = "neutral only"  # only the value that changes nothing; any other is a 400
    IGNORED = "ignored"  # accepted: by its nature it changes nothing in an answer here
    REFUSED = "400"  # any value but null is a 400 naming the field


@attrs.frozen(kw_only=True)
class FieldRule:
    name: str
    support: Support
    how: str
    """docs/API.md's text: what the field does here, or why it is refused."""
    neutral: tuple[Any, ...] = ()
    """NEUTRAL: the accepted values (null always is)."""
    refusal: Mapping[str, Any] | None = None
    """Body fields that get a 400 naming this field (the validation tests send them)."""


SUPPORTED, PARTIAL, NEUTRAL, IGNORED, REFUSED = (
    Support.SUPPORTED,
    Support.PARTIAL,
    Support.NEUTRAL,
    Support.IGNORED,
    Support.REFUSED,
)


def rule(
    name: str,
    support: Support,
    how: str,
    *,
    neutral: tuple[Any, ...] = (),
    bad: Any = None,
    refusal: Mapping[str, Any] | None = None,
) -> FieldRule:
    if refusal is None and bad is not None:
        refusal = {name: bad}
    return FieldRule(name=name, support=support, how=how, neutral=neutral, refusal=refusal)
