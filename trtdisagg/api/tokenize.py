"""vLLM's `POST /tokenize` and `POST /detokenize`: a prompt or a conversation as the generation
routes read it, and token ids back to text. Pure: the caller gives the tokenizer.

A conversation is rendered and encoded by the chat route's own code (`Tokenizer.chat_prompt`,
with `messages`, `tools` and the rendering controls checked as that route checks them), so a
client counts exactly the tokens a chat request of the same fields would prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from trtdisagg.api.chat import ChatRender
from trtdisagg.api.codec import parse_request, structure_body
from trtdisagg.api.errors import bad_request
from trtdisagg.api.protocol import ChatCompletionRequest

Json = dict[str, Any]

# The fields of a tokenize request that it shares with a chat request.
CHAT_FIELDS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "add_special_tokens",
)


class TextTokenizer(Protocol):
    """`trtdisagg.worker.tokenization.Tokenizer`, as these routes use it."""

    vocab_size: int

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def chat_prompt(self, chat: ChatRender) -> tuple[str, list[int]]: ...

    def token_strings(self, ids: Sequence[int]) -> list[str | None]: ...


@attrs.frozen(kw_only=True)
class TokenizeRequest:
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None  # checked as the chat route's (`ChatCompletionRequest`)
    tools: list[Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # The tokenizer's own BOS and the like: by default yes for a prompt (as completions encode
    # one), no for messages (their template writes them), as vLLM does.
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


@attrs.frozen(kw_only=True)
class DetokenizeRequest:
    model: str | None = None
    tokens: list[int] | None = None


def tokenize(body: object, tokenizer: TextTokenizer, *, max_model_len: int | None) -> Json:
    """The answer to `POST /tokenize`: ``count``, ``max_model_len``, ``tokens`` and, when asked
    for, ``token_strs`` (each token as the vocabulary writes it).

    Raises:
        ApiError: 400 naming the field at fault.
    """
    req = structure_body(body, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("prompt: give either prompt or messages", param="prompt")
    if req.prompt is not None:
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        assert isinstance(body, dict)  # structure_body refuses anything else
        chat = {key: body[key] for key in CHAT_FIELDS if body.get(key) is not None}
        render = ChatRender.of(parse_request(chat, ChatCompletionRequest))
        try:
            _, ids = tokenizer.chat_prompt(render)
        except ValueError as exc:  # a template's own error, or a message it cannot continue
            raise bad_request(f"messages: {exc}", param="messages") from None
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.token_strings(ids) if req.return_token_strs else None,
    }


def detokenize(body: object, tokenizer: TextTokenizer) -> Json:
    """The answer to `POST /detokenize`: ``prompt``, the ids' text, special tokens included.

    Raises:
        ApiError: 400 naming ``tokens`` when they are missing or outside the vocabulary.
    """
    req = structure_body(body, DetokenizeRequest)
    if req.tokens is None:
        raise bad_request("tokens: required field missing", param="tokens")
    vocab = tokenizer.vocab_size
    outside = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if outside is not None:
        raise bad_request(
            f"tokens: token id {outside} outside the vocabulary [0, {vocab})", param="tokens"
        )
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}


def model_of(body: object) -> str | None:
    """The body's `model`, when it names one (checked against the served model by the route)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None
