"""Tokenizer: text <-> token ids, chat templates, and streaming detokenization.

Reads a Hugging Face tokenizer directory (`tokenizer.json` + `tokenizer_config.json`) with the
`tokenizers` library and renders `chat_template` with a sandboxed jinja2 environment configured
like transformers', so prompts and ids agree with `AutoTokenizer` on the same files.

Chat prompts already contain the BOS text when the template writes it: encode them with
`add_special_tokens=False`, as transformers' `apply_chat_template(tokenize=True)` does.

OpenAI's `developer` role (its newer name for the instructions `system` gave) reaches a template
that never names it as `system`: most templates know only system, user, assistant and tool, and
either refuse another role or render it as a turn the model was not trained on. A template that
names `developer` gets it as sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import attrs
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _RustTokenizer

from trtdisagg.api.chat import ChatRender, continued
from trtdisagg.api.reasoning import THINK_END, THINK_START, ThinkTokens


class TokenizerError(ValueError):
    """The tokenizer files are missing or invalid, or a chat template failed to render."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise TokenizerError(f"{path}: not valid JSON ({error})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config stores special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return str(value["content"])
    return None if value is None else str(value)


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


class Tokenizer:
    def __init__(
        self, *, tokenizer: _RustTokenizer, config: Mapping[str, Any], eos_ids: Iterable[int]
    ) -> None:
        self._tokenizer = tokenizer
        # Read once: with added tokens, the Rust side builds the whole vocabulary map on every
        # call (~30-70 ms for 128k ids), and each request checks its ids against this.
        self.vocab_size: int = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        eos_id = self._id_of(self.eos_token)
        self.eos_token_ids: frozenset[int] = frozenset(
            {*eos_ids, *(() if eos_id is None else (eos_id,))}
        )
        # When the config says explicitly whether to add BOS/EOS, that wins over the
        # post-processor (transformers rebuilds the post-processor from these flags).
        self._add_bos: bool | None = config.get("add_bos_token")
        self._add_eos: bool | None = config.get("add_eos_token")
        self.chat_template: str | None = _pick_template(config.get("chat_template"))
        self._template: jinja2.Template | None = None
        self._renames_developer = "developer" not in (self.chat_template or "")
        self.think_tokens = self._think_tokens()
        if self.chat_template is not None:
            # Compiled once, here: a broken template fails at start-up, not on a request.
            try:
                self._template = _compile(self.chat_template)
            except jinja2.TemplateError as error:
                raise TokenizerError(f"chat template does not compile: {error}") from None

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json` and the eos ids of
        `generation_config.json` / `config.json` from a model directory.

        Raises:
            TokenizerError: tokenizer.json is missing or unreadable.
        """
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{file} not found: the model directory has no fast tokenizer")
        try:
            tokenizer = _RustTokenizer.from_file(str(file))
        except Exception as error:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{file}: cannot load ({error})") from None
        config = _read_json(path / "tokenizer_config.json")
        if config.get("chat_template") is None and (path / "chat_template.jinja").is_file():
            config["chat_template"] = (path / "chat_template.jinja").read_text()
        eos_ids = _ids(_read_json(path / "generation_config.json").get("eos_token_id"))
        eos_ids |= _ids(_read_json(path / "config.json").get("eos_token_id"))
        return cls(tokenizer=tokenizer, config=config, eos_ids=eos_ids)

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` holds it (for llguidance's own tokenizer)."""
        return str(self._tokenizer.to_str())

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def _think_tokens(self) -> ThinkTokens | None:
        """A reasoning model's `<think>` and `</think>` (`api/reasoning.py`): when its chat
        template writes them, each is one token, and decoding keeps them in the text."""
        if THINK_END not in (self.chat_template or ""):
            return None
        start, end = self._id_of(THINK_START), self._id_of(THINK_END)
        if start is None or end is None:
            return None
        if self.decode([start]) != THINK_START or self.decode([end]) != THINK_END:
            return None
        return ThinkTokens(start=start, end=end)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not add_special_tokens or (self._add_bos is None and self._add_eos is None):
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        ids = list(self._tokenizer.encode(text, add_special_tokens=False).ids)
        if self._add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        eos_id = self._id_of(self.eos_token)
        if self._add_eos and eos_id is not None:
            ids.append(eos_id)
        return ids

    def token_strings(self, ids: Sequence[int]) -> list[str | None]:
        """Each id as the vocabulary writes it (byte-level: `Ġthe`); None for an unknown id."""
        return [self._tokenizer.id_to_token(i) for i in ids]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def chat_prompt(self, chat: ChatRender) -> tuple[str, list[int]]:
        """A chat request's prompt, as text and as token ids (`api/chat.py`).

        Raises:
            TokenizerError: no chat template, the template failed, or the last message, to be
                continued, is not in its text.
        """
        text = self.apply_chat_template(
            chat.messages,
            add_generation_prompt=chat.add_generation_prompt,
            tools=chat.tools,
            template_kwargs=chat.template_kwargs,
        )
        if chat.continue_final_message:
            try:
                text = continued(text, chat.messages[-1]["content"] or "")
            except ValueError as exc:
                raise TokenizerError(str(exc)) from None
        return text, self.encode(text, add_special_tokens=chat.add_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any] | Any],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render the chat template over `messages` (dicts, or attrs instances); `tools` is the
        template's `tools` variable (OpenAI's tool objects), None when there are none;
        `template_kwargs` are more variables (none of `chat.TEMPLATE_VARIABLES`).

        Raises:
            TokenizerError: no chat template, or the template failed (e.g. `raise_exception`).
        """
        if self._template is None:
            raise TokenizerError("the tokenizer has no chat_template")
        rendered = [dict(m) if isinstance(m, Mapping) else attrs.asdict(m) for m in messages]
        if self._renames_developer:
            for message in rendered:
                if message.get("role") == "developer":
                    message["role"] = "system"
        try:
            own = {
                "messages": rendered,
                "tools": None if tools is None else list(tools),
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token or "",
                "eos_token": self.eos_token or "",
            }
            return self._template.render({**(template_kwargs or {}), **own})
        except jinja2.TemplateError as error:
            raise TokenizerError(f"chat template: {error}") from None

    def incremental_detokenizer(
        self, *, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(tokenizer=self, skip_special_tokens=skip_special_tokens)


def _pick_template(value: Any) -> str | None:
    # A list of named templates is also allowed; the one named "default" is the chat template.
    if isinstance(value, list):
        named = {t["name"]: t["template"] for t in value}
        return named.get("default")
    return None if value is None else str(value)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _compile(source: str) -> jinja2.Template:
    # Same environment transformers uses: sandboxed, blocks trimmed, a raise_exception helper.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # Llama 3.1+ templates
    return env.from_string(source)


# Tokens held back at most while the text ends in U+FFFD. A UTF-8 character has at most four
# bytes and each token at least one, so an incomplete character starts in the last three tokens:
# beyond this, all but those are released (invalid bytes, which a random model emits, stay U+FFFD).
MAX_HELD_TOKENS = 8
_TAIL_TOKENS = 3


@attrs.define(eq=False, kw_only=True)
class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, one short decode per token.

    It decodes a window of ids (from `_prefix`, a character boundary before the emitted part,
    to the end) and emits what the window adds beyond the emitted part, whose text is kept
    (`_prefix_text`), so each token costs one decode of a few ids whatever the sequence's
    length. Output is held back while the text ends in U+FFFD: the last tokens may be the first
    bytes of a multi-byte character (at most `MAX_HELD_TOKENS`). A token that adds no text (a
    skipped special token) moves the window on too, so a model that emits many of them does not
    make the window grow. Invariant: the deltas so far, plus `flush()`, concatenate to
    `decode(all ids)`.
    """

    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    ids: list[int] = attrs.field(factory=list)
    _prefix: int = 0  # window start: a character boundary before `_read`
    _read: int = 0  # ids before this are emitted
    _prefix_text: str = ""  # the decoded text of ids[_prefix:_read]

    def add(self, token_id: int) -> str:
        """Feed one token id; return the text it completes (may be "")."""
        ids = self.ids
        ids.append(token_id)
        text = self._decode(ids[self._prefix :])
        if text.endswith("\ufffd"):
            if len(ids) - self._read > MAX_HELD_TOKENS:
                return self._release_head(text)
            return ""
        if len(text) < len(self._prefix_text):
            return ""
        delta = text[len(self._prefix_text) :]
        self._advance(len(ids))
        return delta

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """Whatever is held back (an incomplete trailing character decodes as U+FFFD)."""
        text = self._decode(self.ids[self._prefix :])
        delta = text[len(self._prefix_text) :]
        self._advance(len(self.ids))
        return delta

    def _release_head(self, text: str) -> str:
        """Emit all but the last tokens, when the window splits there at a character boundary
        (the head's text is where the whole window's starts); else keep holding."""
        end = len(self.ids) - _TAIL_TOKENS
        head = self._decode(self.ids[self._prefix : end])
        if not text.startswith(head) or len(head) < len(self._prefix_text):
            return ""
        delta = head[len(self._prefix_text) :]
        self._advance(end)
        return delta

    def _advance(self, read: int) -> None:
        self._prefix, self._read = self._read, read
        self._prefix_text = self._decode(self.ids[self._prefix : self._read])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
