"""The prompt's token ids at the coordinator, for KV-aware routing and conditional disaggregation.

Routing by cached prefix needs the prompt's tokens exactly as the workers will see them, so the
coordinator loads the same tokenizer (`trtdisagg.worker.tokenization.Tokenizer.from_dir` on the
``model_path`` a worker reports in ``/server_info``) and tokenizes the way the worker does
(`WorkerService._prompt_ids`): completions ``encode(prompt)``; chat
``Tokenizer.chat_prompt(ChatRender.of(request))``, which renders and encodes the messages and
tools of `api/chat.py` under the request's rendering controls.

When the tokenizer cannot be loaded (the model directory is not on this machine, or the worker
package is not installed here) text prompts get no token ids: `kv_cache_aware` then routes by load
alone (round robin among equals) and conditional disaggregation sends the request through ctx.
A stream resumed on another gen (`continuation.py`) uses the tokenizer too, to carry the dead
leg's text and stop-string state across. It is loaded once the servers are up (`serve.py`), so a
first migration, when several streams resume at once, does not wait for it.
Prompts given as token ids always work. The coordinator never rewrites the request body with
its own token ids: the worker's tokenization stays the source of truth.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from trtdisagg.api.chat import ChatRender
from trtdisagg.api.codec import single_prompt
from trtdisagg.api.protocol import ChatCompletionRequest, CompletionRequest
from trtdisagg.api.validation import kept_prompt

log = logging.getLogger(__name__)

AnyRequest = CompletionRequest | ChatCompletionRequest

INLINE_CHARS: Final = 4096
"""Shorter prompts are tokenized on the event loop; longer ones in a worker thread."""


def prompt_text(req: AnyRequest) -> str | None:
    if isinstance(req, CompletionRequest):
        prompt = single_prompt(req)
        return prompt if isinstance(prompt, str) else None
    return "\n".join(m.text() for m in req.messages or [])


def given_token_ids(req: AnyRequest) -> list[int] | None:
    """Token ids the client gave directly (``prompt_token_ids`` or a token-list prompt)."""
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    if isinstance(req, CompletionRequest):
        prompt = single_prompt(req)
        if isinstance(prompt, list):
            return list(prompt)
    return None


@attrs.define(eq=False, kw_only=True)
class PromptTokenizer:
    _tokenizer: Any = None
    _tried: set[str] = attrs.field(factory=set)
    _lock: trio.Lock = attrs.field(factory=trio.Lock)

    async def token_ids(self, req: AnyRequest, model_path: str | None) -> list[int] | None:
        """The prompt's token ids, or None when they cannot be known here."""
        given = given_token_ids(req)
        if given is not None:
            return given
        tokenizer = await self._load(model_path)
        if tokenizer is None:
            return None
        text = prompt_text(req) or ""
        if len(text) < INLINE_CHARS:
            return _encode(tokenizer, req)
        return await trio.to_thread.run_sync(_encode, tokenizer, req)

    async def tokenizer(self, model_path: str | None) -> Any:
        """The workers' tokenizer (loaded once, in a thread), or None when it cannot be."""
        return await self._load(model_path)

    async def _load(self, model_path: str | None) -> Any:
        if self._tokenizer is not None or model_path is None:
            return self._tokenizer
        # Callers that come while it loads wait for it (several streams resume at once when a
        # gen stalls): each must get the tokenizer, not the None of "being loaded".
        async with self._lock:
            if self._tokenizer is not None or model_path in self._tried:
                return self._tokenizer
            self._tried.add(model_path)
            try:
                self._tokenizer = await trio.to_thread.run_sync(_load_tokenizer, Path(model_path))
            except Exception as exc:  # an absent or unreadable model dir only disables a feature
                log.warning(
                    "no tokenizer at the coordinator (%s: %s): KV-aware routing and conditional "
                    "disaggregation will only see prompts given as token ids",
                    model_path,
                    exc,
                )
                return None
            log.info("coordinator tokenizer loaded from %s", model_path)
            return self._tokenizer


def _load_tokenizer(model_dir: Path) -> Any:
    # Imported here, in the loading thread: the import alone can hold an event loop for a
    # second on a loaded machine, and a coordinator without the worker package still serves.
    from trtdisagg.worker.tokenization import Tokenizer

    return Tokenizer.from_dir(model_dir)


def _encode(tokenizer: Any, req: AnyRequest) -> list[int] | None:
    try:
        if isinstance(req, CompletionRequest):
            prompt = single_prompt(req)
            assert isinstance(prompt, str)
            ids = list(tokenizer.encode(prompt))
        else:
            _, ids = tokenizer.chat_prompt(ChatRender.of(req))
        return kept_prompt(list(ids), req.truncate_prompt_tokens, None, req.truncation_side)
    except Exception as exc:  # the worker will reject the same prompt with a 400 naming it
        log.debug("coordinator could not tokenize a prompt: %s", exc)
        return None
