"""Stop-string detection over streamed text.

Text that could still grow into a stop string is held back, so a streaming client never sees
the beginning of a stop string that later matches; the final text ends just before the match, or
just after it with `include` (vLLM's `include_stop_str_in_output`).
"""

from __future__ import annotations

import attrs


@attrs.define(eq=False, kw_only=True)
class StopStrings:
    stops: tuple[str, ...]
    include: bool = False  # a match's text ends with the stop string, not before it
    _pending: str = attrs.field(default="", alias="pending")
    stopped: bool = False

    def feed(self, delta: str) -> str:
        """Add new text; return what may be emitted now. Sets `stopped` on a match."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        text = self._pending + delta
        found = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            self.stopped = True
            self._pending = ""
            # The earliest match; of several there, the first listed (as vLLM's check goes).
            cut, stop = min(found, key=lambda match: match[0])
            return text[: cut + len(stop)] if self.include else text[:cut]
        hold = self._longest_partial(text)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """The held-back text, released when the request ends for another reason."""
        text, self._pending = self._pending, ""
        return text

    def _longest_partial(self, text: str) -> int:
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
