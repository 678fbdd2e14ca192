"""The fault spec language and the injector's choices (pure), and the FaultyAgent over loopback."""

from __future__ import annotations

import numpy as np
import pytest

from trtdisagg import cli
from trtdisagg.config import ConfigError, load_worker_config
from trtdisagg.faults.agent import FaultyAgent
from trtdisagg.faults.spec import (
    Fault,
    FaultAction,
    FaultInjector,
    FaultPlan,
    FaultRule,
    FaultSpecError,
    parse_faults,
)
from trtdisagg.transfer.errors import AgentError
from trtdisagg.transfer.protocol.fragments import Fragments
from trtdisagg.transfer.runtime.agents.base import MemoryRegion, XferStatus
from trtdisagg.transfer.runtime.agents.loopback import LoopbackAgent, LoopbackFabric


def test_the_example_spec_parses_rule_by_rule() -> None:
    spec = "drop:TRANSFER_RESULT:1; delay:REQUEST_DATA:200ms;dup:CANCEL;fail_submit:2;" \
        "stall_transfer:1.5s"  # fmt: skip
    plan = parse_faults(spec)
    assert plan.rules == (
        FaultRule(action=FaultAction.DROP, message_type="TRANSFER_RESULT", count=1),
        FaultRule(action=FaultAction.DELAY, message_type="REQUEST_DATA", seconds=0.2),
        FaultRule(action=FaultAction.DUPLICATE, message_type="CANCEL"),
        FaultRule(action=FaultAction.FAIL_SUBMIT, count=2),
        FaultRule(action=FaultAction.STALL_TRANSFER, seconds=1.5),
    )
    assert str(plan) == (
        "drop:TRANSFER_RESULT:1;delay:REQUEST_DATA:200ms;dup:CANCEL;fail_submit:2;"
        "stall_transfer:1500ms"
    )
    assert parse_faults(str(plan)) == plan


@pytest.mark.parametrize("spec", ["", "none", " none ; "])
def test_an_empty_spec_arms_no_rule(spec: str) -> None:
    assert parse_faults(spec) == FaultPlan()
    assert str(FaultPlan()) == "none"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("dorp:CANCEL", "fault rule 1 'dorp:CANCEL': unknown action 'dorp'; known: delay, "),
        ("none;drop", "fault rule 2 'drop': drop needs a message type, e.g. drop:TRANSFER_RESULT"),
        ("drop:RESULT", "fault rule 1 'drop:RESULT': unknown message type 'RESULT'; known: "),
        ("delay:CANCEL", "fault rule 1 'delay:CANCEL': delay needs a duration, e.g. 200ms or 1.5s"),
        ("delay:CANCEL:200", "fault rule 1 'delay:CANCEL:200': duration '200' is not a number "),
        ("stall_transfer:0s", "fault rule 1 'stall_transfer:0s': duration '0s' must be positive"),
        ("fail_submit:0", "fault rule 1 'fail_submit:0': count '0' is not a positive integer"),
        ("dup:CANCEL:-1", "fault rule 1 'dup:CANCEL:-1': count '-1' is not a positive integer"),
        ("drop:CANCEL:1:2", "fault rule 1 'drop:CANCEL:1:2': unexpected '2' after the last "),
    ],
)
def test_a_bad_rule_is_named_with_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError) as info:
        parse_faults(spec)
    assert str(info.value).startswith(message), str(info.value)


def test_a_bad_spec_fails_the_worker_config_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"fault_injection \(TRTDISAGG_FAULTS\): fault rule 1"):
        load_worker_config(None, {"fault_injection": "drop:NOPE"})
    config = load_worker_config(None, {"fault_injection": "dup:CANCEL"})
    assert config.fault_injection == "dup:CANCEL"
    assert load_worker_config(None).fault_injection is None


def test_a_bad_fault_spec_stops_a_worker_at_start_naming_the_rule(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TRTDISAGG_FAULTS", "drop:TRANSFER_RESULT;stall_transfer:soon")
    assert cli.main(["ctx", "--port", "0"]) == 2
    assert (
        "configuration error: worker config: fault_injection (TRTDISAGG_FAULTS): fault rule 2 "
        "'stall_transfer:soon': duration 'soon' is not a number followed by ms or s"
    ) in capsys.readouterr().err


def test_rules_fire_in_order_until_their_count_is_used_up() -> None:
    fired: list[str] = []
    plan = parse_faults("drop:TRANSFER_RESULT:1;delay:TRANSFER_RESULT:50ms:2;fail_submit:1")
    faults = FaultInjector(plan=plan, on_fault=lambda rule: fired.append(str(rule)))
    decisions = [faults.message("TRANSFER_RESULT") for _ in range(5)]
    assert decisions == [
        Fault(action=FaultAction.DROP),
        Fault(action=FaultAction.DELAY, seconds=0.05),
        Fault(action=FaultAction.DELAY, seconds=0.05),
        None,
        None,
    ]
    assert faults.message("REQUEST_DATA") is None
    assert faults.submit() == Fault(action=FaultAction.FAIL_SUBMIT)
    assert faults.submit() is None
    assert fired == [
        "drop:TRANSFER_RESULT:1",
        "delay:TRANSFER_RESULT:50ms:2",
        "delay:TRANSFER_RESULT:50ms:2",
        "fail_submit:1",
    ]
    assert [use.fired for use in faults.statistics().rules] == [1, 2, 1]
    faults.replace(parse_faults("dup:TRANSFER_RESULT"))
    assert faults.message("TRANSFER_RESULT") == Fault(action=FaultAction.DUPLICATE)
    assert faults.statistics().plan == "dup:TRANSFER_RESULT"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _agents(spec: str, clock: _Clock) -> tuple[FaultyAgent, FaultyAgent, np.ndarray, np.ndarray]:
    fabric = LoopbackFabric()
    faults = FaultInjector(plan=parse_faults(spec))
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    writer = FaultyAgent(LoopbackAgent("w", fabric=fabric), faults, clock=clock)
    reader = FaultyAgent(LoopbackAgent("r", fabric=fabric), faults, clock=clock)
    writer.register_memory([MemoryRegion(address=src.ctypes.data, size=64)])
    reader.register_memory([MemoryRegion(address=dst.ctypes.data, size=64)])
    writer.add_remote(reader.local_metadata())
    return writer, reader, src, dst


def _one_write(src: np.ndarray, dst: np.ndarray) -> Fragments:
    return Fragments(np.array([[src.ctypes.data, dst.ctypes.data, 64]], dtype=np.int64))


def test_faulty_agent_fails_then_stalls_submits() -> None:
    clock = _Clock()
    writer, reader, src, dst = _agents("fail_submit:1;stall_transfer:2s:1", clock)
    with pytest.raises(AgentError, match="injected fault"):
        writer.submit(_one_write(src, dst), "r", b"n1")
    handle = writer.submit(_one_write(src, dst), "r", b"n2")
    assert writer.poll(handle) is XferStatus.PENDING  # held back: nothing has landed yet
    assert not dst.any() and reader.get_notifications() == []
    clock.now += 2.0
    assert writer.poll(handle) is XferStatus.DONE
    assert (dst == src).all() and reader.get_notifications() == [("w", b"n2")]
    writer.release(handle)
    dst[:] = 0
    later = writer.submit(_one_write(src, dst), "r", b"n3")
    assert writer.poll(later) is XferStatus.DONE  # the stall rule had one use
    assert (dst == src).all()
    writer.release(later)


def test_a_stalled_write_released_before_its_stall_ends_never_lands() -> None:
    clock = _Clock()
    writer, reader, src, dst = _agents("stall_transfer:1s:1", clock)
    writer.release(writer.submit(_one_write(src, dst), "r", b"cancelled"))
    clock.now += 2.0
    assert not dst.any() and reader.get_notifications() == []
    later = writer.submit(_one_write(src, dst), "r", b"next")
    assert writer.poll(later) is XferStatus.DONE and reader.get_notifications() == [("w", b"next")]


def test_faulty_agent_drops_duplicates_and_delays_write_notices() -> None:
    clock = _Clock()
    writer, reader, src, dst = _agents(
        "drop:WRITE_NOTICE:1;dup:WRITE_NOTICE:1;delay:WRITE_NOTICE:300ms:1", clock
    )
    for notif in (b"a", b"b", b"c", b"d"):
        writer.release(writer.submit(_one_write(src, dst), "r", notif))
    assert reader.get_notifications() == [("w", b"b"), ("w", b"b"), ("w", b"d")]
    clock.now += 0.2
    assert reader.get_notifications() == []
    clock.now += 0.1
    assert reader.get_notifications() == [("w", b"c")]
