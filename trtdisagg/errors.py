"""The trtdisagg exception hierarchy. Every error carries the ids it concerns.

Pure: imports nothing from the package, so any module may raise these. Errors map to HTTP statuses
only at the HTTP edge. Add new classes at the end of this file.
"""

from __future__ import annotations

import enum


class TrtDisaggError(Exception):
    """Base class of every error trtdisagg raises on purpose."""


class CapacityError(TrtDisaggError):
    """A request can never fit: more tokens or blocks than the instance holds or allows.

    Raised at admission, so that the caller can refuse the request (HTTP 400/413) instead of
    queueing something that would wait forever.
    """

    def __init__(self, message: str, *, request_id: int | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class InvalidTransition(TrtDisaggError):
    """A request was asked to move between two states its lifecycle does not connect.

    Always a bug in the caller: it is raised at the state boundary so that the broken contract
    shows up here, with the request id and both states, and not later as wrong tokens.
    """

    def __init__(
        self, request_id: int, from_state: enum.Enum, to_state: enum.Enum, reason: str = ""
    ) -> None:
        message = f"request {request_id}: invalid transition {from_state.name} -> {to_state.name}"
        if reason:
            message += f" ({reason})"
        super().__init__(message)
        self.request_id = request_id
        self.from_state = from_state
        self.to_state = to_state


class WorkerStopped(TrtDisaggError):
    """The worker stopped serving (its model steps keep failing): it takes no new request.

    Raised at admission, so that the caller answers 503 at once instead of queueing a request
    that no step could ever run.
    """


class StartupError(TrtDisaggError):
    """Start-up could not complete (an address that cannot be bound, servers never healthy,
    etcd unreachable)."""
