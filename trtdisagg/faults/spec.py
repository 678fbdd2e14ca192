"""Test-only fault injection: the spec language, and which event each rule hits. Pure.

Faults are armed by the TRTDISAGG_FAULTS environment variable (read by `cli.py` only) and never in
production: unset, no injector exists and no hook runs. A worker with faults armed logs a loud
warning at start, counts every fault it injects (`trtdisagg_faults_injected_total`), and lets a
test replace the rules at run time (`POST /debug/faults`), so that one pair of processes can go
through many scenarios.

Spec: rules separated by `;`, each `action:arguments`:

    drop:TYPE[:N]                 the control message is not sent
    dup:TYPE[:N]                  it is sent twice
    delay:TYPE:DURATION[:N]       it is sent DURATION later; later messages may overtake it
    fail_submit[:N]               the transfer agent refuses to submit a KV write
    stall_transfer:DURATION[:N]   a KV write is held back: its bytes and notification land
                                  DURATION after it was submitted (at the initiator's first poll
                                  after that), and until then it reads PENDING
    none                          no rule: armed, with rules to come from POST /debug/faults

TYPE is a control-message name (`wire.MESSAGE_TAGS`: REQUEST_DATA, TRANSFER_RESULT, CANCEL, ...).
N makes the rule hit only the first N matching events; without it, the rule hits every one.
DURATION is `250ms` or `1.5s`. Example: `drop:TRANSFER_RESULT:1;delay:REQUEST_DATA:200ms`.

Where a rule hits: a ZMQ message where this process sends it (the messenger); a WRITE_NOTICE,
which NIXL delivers along with the write's bytes, where this process receives it (the agent's
notification queue); `fail_submit` and `stall_transfer` in this process's agent. Rules are tried
in order; the first one that matches the event and has uses left decides it.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from typing import Final

import attrs

from trtdisagg.transfer.protocol.wire import MESSAGE_TAGS


class FaultSpecError(ValueError):
    """A fault spec that does not parse; the message names the rule and the part at fault."""


class FaultAction(enum.Enum):
    DROP = "drop"
    DUPLICATE = "dup"
    DELAY = "delay"
    FAIL_SUBMIT = "fail_submit"
    STALL_TRANSFER = "stall_transfer"


MESSAGE_ACTIONS: Final = frozenset({FaultAction.DROP, FaultAction.DUPLICATE, FaultAction.DELAY})
SUBMIT_ACTIONS: Final = frozenset({FaultAction.FAIL_SUBMIT, FaultAction.STALL_TRANSFER})
MESSAGE_TYPES: Final = frozenset(MESSAGE_TAGS.values())

_DURATION = re.compile(r"^(\d+(?:\.\d*)?)(ms|s)$")


@attrs.frozen(kw_only=True)
class FaultRule:
    action: FaultAction
    message_type: str | None = None
    """The control message it hits (message actions only)."""
    seconds: float = 0.0
    """How long a `delay` holds the message, or a `stall_transfer` the write."""
    count: int | None = None
    """How many events it hits; None: every one."""

    def __str__(self) -> str:
        parts = [self.action.value]
        if self.message_type is not None:
            parts.append(self.message_type)
        if self.action in (FaultAction.DELAY, FaultAction.STALL_TRANSFER):
            parts.append(f"{self.seconds * 1000:g}ms")
        if self.count is not None:
            parts.append(str(self.count))
        return ":".join(parts)


@attrs.frozen(kw_only=True)
class FaultPlan:
    rules: tuple[FaultRule, ...] = ()

    def __str__(self) -> str:
        return ";".join(map(str, self.rules)) or "none"


@attrs.frozen(kw_only=True)
class Fault:
    """What to do to one event instead of the normal thing."""

    action: FaultAction
    seconds: float = 0.0


@attrs.frozen(kw_only=True)
class RuleUse:
    rule: str
    fired: int


@attrs.frozen(kw_only=True)
class FaultStatistics:
    plan: str
    rules: tuple[RuleUse, ...]


def parse_faults(spec: str) -> FaultPlan:
    """Parse a fault spec (module docstring). An empty spec or `none` is a plan without rules.

    Raises:
        FaultSpecError: naming the rule (1-based) and what is wrong with it.
    """
    rules = []
    parts = [part.strip() for part in spec.split(";")]
    for number, part in enumerate(parts, start=1):
        if part in ("", "none"):
            continue
        try:
            rules.append(_parse_rule(part))
        except FaultSpecError as exc:
            raise FaultSpecError(f"fault rule {number} {part!r}: {exc}") from None
    return FaultPlan(rules=tuple(rules))


def _parse_rule(text: str) -> FaultRule:
    name, *args = text.split(":")
    try:
        action = FaultAction(name)
    except ValueError:
        known = ", ".join(sorted(a.value for a in FaultAction))
        raise FaultSpecError(f"unknown action {name!r}; known: {known}") from None
    message_type = None
    if action in MESSAGE_ACTIONS:
        if not args:
            raise FaultSpecError(f"{name} needs a message type, e.g. {name}:TRANSFER_RESULT")
        message_type, *args = args
        if message_type not in MESSAGE_TYPES:
            known = ", ".join(sorted(MESSAGE_TYPES))
            raise FaultSpecError(f"unknown message type {message_type!r}; known: {known}")
    seconds = 0.0
    if action in (FaultAction.DELAY, FaultAction.STALL_TRANSFER):
        if not args:
            raise FaultSpecError(f"{name} needs a duration, e.g. 200ms or 1.5s")
        duration, *args = args
        seconds = _parse_duration(duration)
    count = None
    if args:
        count_text, *args = args
        if not count_text.isdigit() or int(count_text) == 0:
            raise FaultSpecError(f"count {count_text!r} is not a positive integer")
        count = int(count_text)
    if args:
        raise FaultSpecError(f"unexpected {':'.join(args)!r} after the last argument")
    return FaultRule(action=action, message_type=message_type, seconds=seconds, count=count)


def _parse_duration(text: str) -> float:
    match = _DURATION.match(text)
    if match is None:
        raise FaultSpecError(f"duration {text!r} is not a number followed by ms or s")
    value, unit = float(match.group(1)), match.group(2)
    if value <= 0:
        raise FaultSpecError(f"duration {text!r} must be positive")
    return value / 1000 if unit == "ms" else value


@attrs.define(eq=False, kw_only=True)
class FaultInjector:
    """The armed plan of one process, and how often each rule has fired.

    Hooks ask it once per event (`message`, `submit`) and get None (behave normally) or the
    Fault to inject. `on_fault` is told of every fault injected (metrics, logs).
    """

    plan: FaultPlan
    on_fault: Callable[[FaultRule], None] = lambda rule: None
    _fired: list[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._fired = [0] * len(self.plan.rules)

    def replace(self, plan: FaultPlan) -> None:
        """Arm another plan; its rules start with every use left."""
        self.plan = plan
        self._fired = [0] * len(plan.rules)

    def message(self, message_type: str) -> Fault | None:
        """A control message of `message_type` is about to be sent (or, WRITE_NOTICE, received)."""
        return self._decide(lambda rule: rule.message_type == message_type)

    def submit(self) -> Fault | None:
        """The agent is about to submit a KV write."""
        return self._decide(lambda rule: rule.action in SUBMIT_ACTIONS)

    def _decide(self, matches: Callable[[FaultRule], bool]) -> Fault | None:
        for index, rule in enumerate(self.plan.rules):
            if not matches(rule):
                continue
            if rule.count is not None and self._fired[index] >= rule.count:
                continue
            self._fired[index] += 1
            self.on_fault(rule)
            return Fault(action=rule.action, seconds=rule.seconds)
        return None

    def statistics(self) -> FaultStatistics:
        uses = (RuleUse(rule=str(rule), fired=n) for rule, n in zip(self.plan.rules, self._fired))
        return FaultStatistics(plan=str(self.plan), rules=tuple(uses))
