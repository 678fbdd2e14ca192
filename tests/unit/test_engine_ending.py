"""How a request ends, as data: what each kind of ending says, and what cannot be said."""

from __future__ import annotations

import pytest

from trtdisagg.worker.engine.ending import Blocks, Ending
from trtdisagg.worker.request import FinishReason


def test_each_ending_settles_blocks_its_own_way() -> None:
    assert Ending.finished(FinishReason.STOP).blocks is Blocks.FREE
    assert Ending.aborted().blocks is Blocks.FREE
    assert Ending.failed("boom").blocks is Blocks.FREE
    assert Ending.handed_over().blocks is Blocks.SEND
    assert Ending.transfer_failed("ctx gone").blocks is Blocks.SETTLED
    assert Ending.dropped(FinishReason.LENGTH).blocks is Blocks.SETTLED


def test_only_the_workers_own_failure_is_internal() -> None:
    assert Ending.failed("boom").internal and Ending.failed("boom").error == "boom"
    assert not Ending.transfer_failed("ctx gone").internal


@pytest.mark.parametrize(
    ("ending", "status"),
    [
        (Ending.finished(FinishReason.STOP), "ok"),
        (Ending.finished(FinishReason.LENGTH), "ok"),
        (Ending.handed_over(), "ok"),
        (Ending.aborted(), "aborted"),
        (Ending.failed("boom"), "error"),
        (Ending.transfer_failed("ctx gone"), "error"),
    ],
)
def test_status_label(ending: Ending, status: str) -> None:
    assert ending.status == status


def test_gen_hears_why_a_kv_will_never_be_sent() -> None:
    assert Ending.aborted().why_not_sent == "it was aborted"
    assert Ending.failed("boom").why_not_sent == "it failed"
    assert Ending.finished(FinishReason.LENGTH).why_not_sent == (
        "it finished at its first token (length), so there is nothing to decode"
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"reason": FinishReason.ERROR},  # an error says what it is
        {"reason": FinishReason.STOP, "error": "no"},  # only an error carries one
        {"reason": FinishReason.ABORT, "internal": True},
        {"reason": FinishReason.ABORT, "blocks": Blocks.SEND},  # only a good ending sends
    ],
)
def test_endings_that_cannot_be(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Ending(**fields)
