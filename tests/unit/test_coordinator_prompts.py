"""The coordinator's tokenizer (`PromptTokenizer`): loaded once, given to every caller."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
import trio.testing

from trtdisagg.coordinator.prompts import PromptTokenizer
from trtdisagg.model.loader import resolve_model


async def test_callers_that_come_while_it_loads_all_get_the_tokenizer() -> None:
    """Streams of a stalled gen resume at once, each asking for the tokenizer while the first
    ask loads it: none may get None (its continuation would lose the text held back)."""
    prompts, path = PromptTokenizer(), str(resolve_model("tiny"))
    got: list[Any] = []

    async def ask() -> None:
        got.append(await prompts.tokenizer(path))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        await trio.testing.wait_all_tasks_blocked()  # the first ask is loading, in a thread
        for _ in range(3):
            nursery.start_soon(ask)
    assert len(got) == 4 and got[0] is not None
    assert all(t is got[0] for t in got)  # loaded once


async def test_a_directory_without_a_tokenizer_gives_none_and_is_not_read_again(
    tmp_path: Path,
) -> None:
    prompts = PromptTokenizer()
    assert await prompts.tokenizer(str(tmp_path)) is None
    (tmp_path / "tokenizer.json").write_text("{}")  # would now fail differently, if read
    assert await prompts.tokenizer(str(tmp_path)) is None
    assert str(tmp_path) in prompts._tried
