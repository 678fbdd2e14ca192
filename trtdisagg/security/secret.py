"""The cluster secret: its one type, its rules, and where it comes from. Pure.

Every process of a cluster holds the same secret: `cache_transceiver_config.cluster_secret` in
the worker's config, or `TRTDISAGG_CLUSTER_SECRET` in its environment (the environment wins; an
empty variable counts as unset). `cli.py` reads the variable and hands it to
`config.load_worker_config`, which calls `resolve_cluster_secret` and checks the result
(`check_cluster_secret`). The worker turns the config's value into a `ClusterSecret`
(`cluster_secret_of`), from which `keys.py` derives every CURVE key.

A secret must be at least `MIN_SECRET_BYTES` bytes of UTF-8 and must not start or end with
whitespace: two processes given "s3cret" and "s3cret\\n" would derive different keys and never
talk, with nothing in either log to say why, so such a value is refused at start instead.

The value never appears in a repr, a log line or `/server_info`: `ClusterSecret` hides it, and
`WorkerConfig.cache_transceiver_config` keeps it out of its repr.
"""

from __future__ import annotations

from typing import Final

import attrs

MIN_SECRET_BYTES: Final = 16
CONFIG_KEY: Final = "cache_transceiver_config.cluster_secret"
ENV_VAR: Final = "TRTDISAGG_CLUSTER_SECRET"


class InvalidClusterSecret(ValueError):
    """The configured cluster secret breaks a rule; the message says which (never the value)."""


def check_cluster_secret(text: str) -> None:
    """Raise InvalidClusterSecret unless `text` is an acceptable cluster secret."""
    if text != text.strip():
        raise InvalidClusterSecret(
            f"{CONFIG_KEY} ({ENV_VAR}) starts or ends with whitespace; remove it, so that every"
            " process derives the same keys"
        )
    size = len(text.encode())
    if size < MIN_SECRET_BYTES:
        raise InvalidClusterSecret(
            f"{CONFIG_KEY} ({ENV_VAR}) is {size} bytes; it must be at least {MIN_SECRET_BYTES}"
            " (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )


@attrs.frozen
class ClusterSecret:
    """A checked cluster secret. Compares by value; its repr never shows it."""

    _value: bytes = attrs.field(repr=False, alias="value")

    @classmethod
    def parse(cls, text: str) -> ClusterSecret:
        """InvalidClusterSecret unless `text` follows the rules (module docstring)."""
        check_cluster_secret(text)
        return cls(text.encode())

    @property
    def value(self) -> bytes:
        """The raw secret, for key derivation only."""
        return self._value

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"


def resolve_cluster_secret(configured: str | None, from_env: str | None) -> str | None:
    """The secret a worker runs with: the environment's value when set and not empty, else
    the configured one; None when neither is set (no CURVE: see `policy.py`)."""
    if from_env:
        return from_env
    return configured


def cluster_secret_of(configured: str | None) -> ClusterSecret | None:
    """The resolved config value (`resolve_cluster_secret`) as a ClusterSecret, or None."""
    return None if configured is None else ClusterSecret.parse(configured)
