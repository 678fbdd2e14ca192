"""Whether a worker's control plane runs with CURVE, unsecured on loopback, or not at all. Pure.

    mode = control_plane_mode(config.host, cluster_secret_of(transfer.cluster_secret))

* With a cluster secret: `CURVE`, on any bind address.
* Without one, on a loopback bind (`127.0.0.0/8`, `::1`, `localhost`): `UNSECURED_LOOPBACK`,
  today's plain TCP. Only processes of this host can reach it; the worker says so in one log
  line at start (`UNSECURED_LOOPBACK_LOG`).
* Without one, on any other address (`0.0.0.0`, a NIC's address, a DNS name): refused with
  `InsecureControlPlane`, a ConfigError naming both ways to set the secret, before anything binds.

Called once per worker process at start, before the control ROUTER binds.
"""

from __future__ import annotations

import enum
import ipaddress
from typing import Final

from trtdisagg.config import ConfigError
from trtdisagg.security.secret import CONFIG_KEY, ENV_VAR, ClusterSecret

UNSECURED_LOOPBACK_LOG: Final = (
    "control plane unauthenticated (no " + CONFIG_KEY + " / " + ENV_VAR + "): plain TCP, "
    "bound to loopback %s only"
)


SECURED_LOG: Final = "control plane secured: CURVE, keyed by the cluster secret"


class ControlPlaneMode(enum.Enum):
    CURVE = "curve"
    UNSECURED_LOOPBACK = "unsecured-loopback"


class InsecureControlPlane(ConfigError):
    """A non-loopback control plane without a cluster secret."""


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a bind address from config) names the loopback interface only. A DNS
    name other than `localhost` is not: whatever it resolves to is not ours to assume."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def control_plane_mode(host: str, secret: ClusterSecret | None) -> ControlPlaneMode:
    """How the control plane bound to `host` runs; InsecureControlPlane when it must not."""
    if secret is not None:
        return ControlPlaneMode.CURVE
    if is_loopback_host(host):
        return ControlPlaneMode.UNSECURED_LOOPBACK
    raise InsecureControlPlane(
        f"host {host!r} is not a loopback address, and the control plane has no cluster secret:"
        f" any process that can reach it could read and change KV. Set {CONFIG_KEY} in the"
        f" worker config or {ENV_VAR} in its environment (the same value on every worker of"
        " the cluster), or bind to 127.0.0.1"
    )
