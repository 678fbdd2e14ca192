"""The tiny model's tokenizer: a real byte-level BPE, built deterministically from a fixed corpus.

Byte-level means every UTF-8 string round-trips. Merges are learned here in plain Python (most
frequent adjacent pair, ties broken by the pair itself) rather than with the `tokenizers` trainer,
whose tie-breaking is not promised to be stable across runs; the result is then assembled into a
`tokenizers` BPE so the fast Rust encoder, HF's `AutoTokenizer` and our `Tokenizer` all read it.

Ids: the special tokens first (0..6), then the 256 byte symbols, then merges, then reserved special
tokens padding the vocabulary to exactly the model's `vocab_size`, so every id a random model can
emit decodes.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Final

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
END_OF_TURN: Final = "<|end|>"
SPECIAL_TOKENS: Final = (PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>", END_OF_TURN)
MIN_VOCAB_SIZE: Final = len(SPECIAL_TOKENS) + 256

CHAT_TEMPLATE: Final = (
    "{{- bos_token }}\n"
    "{%- if tools %}\n"
    "{{- '<|system|>\\nTools:\\n' }}\n"
    "{%- for tool in tools %}\n"
    "{{- (tool.function if tool.function is defined else tool) | tojson }}\n"
    "{{- '\\n' }}\n"
    "{%- endfor %}\n"
    "{{- '<|end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "{{- raise_exception('unsupported role: ' + message['role']) }}\n"
    "{%- endif %}\n"
    "{%- if message['role'] == 'tool' %}\n"
    "{{- '<|user|>\\n<tool_response id=' + (message.tool_call_id or '') | tojson + '>\\n' }}\n"
    "{{- (message['content'] or '') + '\\n</tool_response><|end|>\\n' }}\n"
    "{%- else %}\n"
    "{{- '<|' + message['role'] + '|>\\n' + (message['content'] or '') }}\n"
    "{%- for call in message.tool_calls or [] %}\n"
    "{%- set arguments = call.function.arguments %}\n"
    "{{- '<tool_call>{\"name\": ' + call.function.name | tojson + ', \"arguments\": ' }}\n"
    "{{- (arguments if arguments is string else arguments | tojson) + '}</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{{- '<|end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|assistant|>\\n' }}\n"
    "{%- endif %}\n"
)
"""The tiny model's chat template. Messages read `<|role|>\\n{content}<|end|>\\n`. With `tools`, a
system block lists them first (`Tools:` then each function's JSON, one a line). An assistant's
tool calls follow its content as `<tool_call>{"name": N, "arguments": A}</tool_call>`; a tool
result is a user turn `<tool_response id="{tool_call_id}">\\n{content}\\n</tool_response>`, as
Qwen2.5's template writes them. Without tools or tool turns, those parts render nothing."""

_CORPUS: Final = """\
The quick brown fox jumps over the lazy dog. A large language model predicts the next token of a
text from the tokens before it. Serving such a model has two phases: the prefill phase reads the
whole prompt at once and fills the key-value cache, and the decode phase then produces one token
at a time, reading the cache on every step. Prefill is limited by compute, decode by memory
bandwidth, so running them on separate machines lets each phase use the hardware it needs.
The context server sends the cache to the generation server over a fast network, and the
generation server continues the request as if it had computed the prompt itself.
Once upon a time there was a little robot who wanted to learn how to write stories. Every morning
the robot read a book, and every evening it wrote a story of its own. The stories were short at
first, but they grew longer and better as the days went by. The robot was happy, and so were the
children who read its stories before they went to sleep.
def generate(model, prompt, max_tokens):
    tokens = tokenize(prompt)
    for step in range(max_tokens):
        logits = model.forward(tokens)
        next_token = int(logits[-1].argmax())
        tokens.append(next_token)
        if next_token == end_of_text:
            break
    return detokenize(tokens)
Questions and answers: What is the capital of France? The capital of France is Paris. How many
days are there in a week? There are seven days in a week. What is two plus two? Two plus two is
four. Which is larger, the sun or the moon? The sun is much larger than the moon.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 -42 1e-3 0x1f
Le renard brun saute par-dessus le chien paresseux. Der schnelle braune Fuchs springt über den
faulen Hund. El rápido zorro marrón salta sobre el perro perezoso. 敏捷的棕色狐狸跳过了懒狗。
"""


def _learn_merges(num_merges: int) -> list[tuple[str, str]]:
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = Counter(piece for piece, _ in pre.pre_tokenize_str(_CORPUS))
    splits = {word: list(word) for word in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            symbols = splits[word]
            for pair in itertools.pairwise(symbols):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        if pairs[best] < 2:
            break
        merges.append(best)
        for word, symbols in splits.items():
            merged: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            splits[word] = merged
    return merges


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids, the same on every call."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size} < {MIN_VOCAB_SIZE} (specials + 256 bytes)")
    vocab: dict[str, int] = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    merges: list[tuple[str, str]] = []
    for a, b in _learn_merges(vocab_size - len(vocab)):
        if len(vocab) == vocab_size:
            break
        merges.append((a, b))
        vocab.setdefault(a + b, len(vocab))  # two merges may spell the same token
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - len(vocab))]
    for token in reserved:
        vocab[token] = len(vocab)

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token in (*SPECIAL_TOKENS, *reserved)
        ]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return tokenizer


def write_tokenizer_files(out_dir: Path, vocab_size: int, *, model_max_length: int = 4096) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into `out_dir`."""
    tokenizer = build_tokenizer(vocab_size)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def special_token_id(token: str) -> int:
    return SPECIAL_TOKENS.index(token)
