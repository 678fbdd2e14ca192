"""A warning, once per name, for each top-level request field that this server does not know.

Such fields are ignored (docs/API.md: clients send other servers' extensions), but a misspelt one
("max_token") would otherwise change an answer without a word. Each name is told once per
process, and at most `MAX_NAMES` names in all: the names come from clients, so the memory they
hold here stays bounded.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any, Final

import attrs

log = logging.getLogger("trtdisagg.api")

MAX_NAMES: Final = 64
MAX_NAME_CHARS: Final = 64  # of a name as logged and kept


@attrs.define(eq=False)
class UnknownFields:
    limit: int = MAX_NAMES
    _told: set[str] = attrs.Factory(set)
    _silenced: bool = False  # the limit was reached, and said

    def note(self, body: Mapping[str, Any], known: Collection[str], route: str) -> None:
        """Warn of each key of `body` outside `known` not warned of before."""
        for key in body:
            if key in known:
                continue
            name = key[:MAX_NAME_CHARS]
            if name in self._told or self._silenced:
                continue
            if len(self._told) >= self.limit:
                self._silenced = True
                log.warning(
                    "%s: more unknown request fields are ignored; no more are named (%d were)",
                    route, self.limit,
                )  # fmt: skip
                continue
            self._told.add(name)
            log.warning(
                "%s: ignored the unknown request field %r (not an OpenAI field nor one of this "
                "server's extensions, docs/API.md); said once per process",
                route, name,
            )  # fmt: skip
