from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtdisagg.api.chat import ChatRender
from trtdisagg.api.codec import parse_request
from trtdisagg.api.protocol import ChatCompletionRequest
from trtdisagg.model.tiny import TinySpec, write_checkpoint
from trtdisagg.model.tiny_tokenizer import build_tokenizer, write_tokenizer_files
from trtdisagg.worker.tokenization import (
    MAX_HELD_TOKENS,
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
)

VOCAB = 512
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing\ttabs\t\nand new lines\n\n",
    "Ünïcödé: 敏捷的棕色狐狸 🦊🚀 ∑ x² — “quotes”",
    "<|user|>special tokens in text<|end|>",
    "",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_checkpoint(
        TinySpec(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=32),
        path,
    )
    return path


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@attrs.frozen(kw_only=True)
class Message:
    role: str
    content: str


def test_round_trip_and_bos(tok: Tokenizer) -> None:
    for text in TEXTS[:3]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id == 1
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids) == text
    special = tok.encode(TEXTS[3], add_special_tokens=False)
    assert special[0] == 4
    assert special[-1] == 6
    assert tok.decode(special) == "special tokens in text"
    assert tok.decode(special, skip_special_tokens=False) == TEXTS[3]


def test_vocab_and_eos(tok: Tokenizer) -> None:
    assert tok.vocab_size == VOCAB
    assert tok.eos_token_ids == frozenset({2, 6})  # <|eos|> and the end-of-turn token


class _CountingTokenizer:
    """Wraps the Rust tokenizer and counts vocabulary-size reads."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.size_reads = 0

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        self.size_reads += 1
        return int(self.inner.get_vocab_size(with_added_tokens=with_added_tokens))  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_vocab_size_is_read_once() -> None:
    # With added tokens, the Rust call rebuilds the vocabulary map (~50 ms at 128k ids) and
    # every request checks its ids against the size: reading it per request stalled the
    # worker's event loop for seconds under bursts on the GPU.
    counting = _CountingTokenizer(build_tokenizer(VOCAB))
    tok = Tokenizer(tokenizer=counting, config={}, eos_ids=())  # type: ignore[arg-type]
    assert [tok.vocab_size for _ in range(100)] == [VOCAB] * 100
    assert counting.size_reads == 1


def test_tokenizer_is_deterministic() -> None:
    assert build_tokenizer(VOCAB).to_str() == build_tokenizer(VOCAB).to_str()
    with pytest.raises(ValueError, match="vocab_size 100 < 263"):
        build_tokenizer(100)


def test_chat_template(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = tok.apply_chat_template(messages)
    assert prompt == "<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nHi!<|end|>\n<|assistant|>\n"
    as_attrs = [Message(role=m["role"], content=m["content"]) for m in messages]
    assert tok.apply_chat_template(as_attrs, add_generation_prompt=False) == prompt.removesuffix(
        "<|assistant|>\n"
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids.count(1) == 1  # the template wrote BOS; encoding must not add another
    with pytest.raises(TokenizerError, match="unsupported role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_the_developer_role_is_system_to_a_template_that_does_not_name_it(
    tok: Tokenizer, tmp_path: Path
) -> None:
    sent = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    as_system = [{"role": "system", "content": "Be brief."}, sent[1]]
    assert tok.apply_chat_template(sent) == tok.apply_chat_template(as_system)
    assert sent[0]["role"] == "developer"  # the caller's messages are left as they were
    write_tokenizer_files(tmp_path, VOCAB)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(sent) == "system:Be brief.;user:Hi!;"
    config["chat_template"] = (
        "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}"
        "{{ m.role }}:{{ m.content }};{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    named = Tokenizer.from_dir(tmp_path).apply_chat_template(sent)
    assert named == "Ddeveloper:Be brief.;user:Hi!;"  # a template that names it gets it


def test_matches_transformers(model_dir: Path, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        assert tok.encode(text) == hf(text)["input_ids"]
        assert (
            tok.encode(text, add_special_tokens=False)
            == hf(text, add_special_tokens=False)["input_ids"]
        )
        ids = tok.encode(text)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    for generation in (True, False):
        expected = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation
        )
        assert tok.apply_chat_template(messages, add_generation_prompt=generation) == expected


def test_continue_final_message_and_template_kwargs_render_as_transformers_does(
    model_dir: Path, tok: Tokenizer, tmp_path: Path
) -> None:
    """The prompt ends inside the last message (its trailing spaces kept only where the
    template keeps them), and template kwargs reach the template, as transformers renders
    them; the request's own variables win over kwargs of the same name."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    for reply in ("The answer is", "The answer is ", "  4 and 4"):
        messages = [{"role": "user", "content": "What is 2+2?"},
                    {"role": "assistant", "content": reply}]  # fmt: skip
        chat = ChatRender(messages=messages, tools=None, add_generation_prompt=False,
                          continue_final_message=True)  # fmt: skip
        text, ids = tok.chat_prompt(chat)
        assert text == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
        )
        assert text.rstrip().endswith(reply.strip())  # no end of turn after it
        assert ids == tok.encode(text, add_special_tokens=False)
    with_bos = tok.chat_prompt(attrs.evolve(chat, add_special_tokens=True))[1]
    assert with_bos == [tok.bos_token_id, *ids]  # the template wrote one BOS, encoding another
    empty = attrs.evolve(chat, messages=[*messages[:1], {"role": "assistant", "content": " "}])
    with pytest.raises(TokenizerError, match="continue_final_message"):
        tok.chat_prompt(empty)
    write_tokenizer_files(tmp_path, VOCAB)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
        "{% for m in messages %}{{ m.content }};{% endfor %}{{ bos_token }}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    own, hf_own = Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    plain = ChatRender(messages=[{"role": "user", "content": "Hi"}], tools=None)
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        text, _ = own.chat_prompt(attrs.evolve(plain, template_kwargs=kwargs))
        assert text == hf_own.apply_chat_template(plain.messages, tokenize=False, **kwargs)
    assert own.chat_prompt(attrs.evolve(plain, template_kwargs={"enable_thinking": False}))[0] == (
        f"/no_think Hi;{own.bos_token or ''}"
    )
    clashing = attrs.evolve(plain, template_kwargs={"bos_token": "X", "messages": []})
    assert own.chat_prompt(clashing)[0] == own.chat_prompt(plain)[0]
    # vLLM's `documents` reach the template as its variable of that name
    config["chat_template"] = (
        "{% for d in documents %}[{{ d.title }}] {% endfor %}{{ messages[-1].content }}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    rag = Tokenizer.from_dir(tmp_path)
    body = {"messages": [{"role": "user", "content": "Hi"}],
            "documents": [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}],
            "chat_template_kwargs": {"documents": []}}  # fmt: skip
    req = parse_request(body, ChatCompletionRequest)
    assert rag.chat_prompt(ChatRender.of(req))[0] == "[a] [b] Hi"  # the field over the kwargs


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]  # fmt: skip


def test_chat_template_renders_tools_and_tool_turns(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template(TOOL_TURNS, tools=TOOLS)
    function = json.dumps(TOOLS[0]["function"], ensure_ascii=False)
    assert prompt == (
        f"<|bos|><|system|>\nTools:\n{function}\n<|end|>\n"
        "<|user|>\nWeather in Paris?<|end|>\n"
        '<|assistant|>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "</tool_call><|end|>\n"
        '<|user|>\n<tool_response id="call_1">\nsunny\n</tool_response><|end|>\n'
        "<|assistant|>\n"
    )
    plain = tok.apply_chat_template(TOOL_TURNS[:1])
    assert tok.apply_chat_template(TOOL_TURNS[:1], tools=None) == plain
    assert "Tools:" not in plain


def test_tools_render_as_transformers_renders_them(model_dir: Path, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    expected = hf.apply_chat_template(
        TOOL_TURNS, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert tok.apply_chat_template(TOOL_TURNS, tools=TOOLS) == expected


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json not found"):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_file_and_missing_template(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path, VOCAB)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="no chat_template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    )
    assert (
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
        == "[x]"
    )


def test_detokenizer_holds_back_split_characters(tok: Tokenizer) -> None:
    ids = tok.encode("a🦊", add_special_tokens=False)
    assert len(ids) == 5  # 'a' + the emoji's four byte tokens
    detok = tok.incremental_detokenizer()
    assert [detok.add(i) for i in ids] == ["a", "", "", "", "🦊"]
    assert detok.flush() == ""


def _stream(tok: Tokenizer, ids: list[int], *, skip_special_tokens: bool = True) -> str:
    detok = tok.incremental_detokenizer(skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    assert all(not d.endswith("\ufffd") for d in deltas)  # never emits a dangling partial char
    return "".join(deltas) + detok.flush()


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40))
def test_detokenizer_deltas_concatenate_to_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    # Byte-level: any text round-trips (special-token spellings come back as themselves).
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert _stream(tok, ids, skip_special_tokens=False) == text
    assert _stream(tok, ids) == tok.decode(ids)


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=VOCAB - 1), max_size=30))
def test_detokenizer_on_arbitrary_ids(tok: Tokenizer, ids: list[int]) -> None:
    # A random model emits arbitrary byte sequences, invalid UTF-8 included.
    detok = tok.incremental_detokenizer()
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids)


@attrs.define
class RecordingTokenizer:
    """A tokenizer whose decode notes how many ids each call decodes."""

    inner: Tokenizer
    windows: list[int] = attrs.Factory(list)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        self.windows.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("kind", ["special", "invalid bytes", "mixed"])
def test_detokenizer_window_stays_short(tok: Tokenizer, kind: str) -> None:
    """Tokens that add no text (skipped special tokens, as a random model over a large padded
    vocabulary emits) and invalid UTF-8 that never completes do not grow the decoded window:
    each token decodes a few ids, however long the stream."""
    special = sorted(tok.eos_token_ids)[0]
    continuation = tok.encode("🦊", add_special_tokens=False)[-1]  # a lone 0xBx byte: invalid
    pattern = {
        "special": [special],
        "invalid bytes": [continuation],
        "mixed": [special, continuation, 97, continuation, continuation, special],
    }[kind]
    ids = (pattern * 400)[:400]
    recorder = RecordingTokenizer(tok)
    detok = IncrementalDetokenizer(tokenizer=recorder)  # type: ignore[arg-type]
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert max(recorder.windows) <= 2 * MAX_HELD_TOKENS, max(recorder.windows)
    assert len(recorder.windows) <= 2 * len(ids) + 2  # at most two short decodes per token


def test_broken_chat_template_fails_at_load(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path, VOCAB)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="chat template does not compile"):
        Tokenizer.from_dir(tmp_path)
