"""`tiny` as a reasoning model: two of its reserved tokens become `<think>` and `</think>` (plain
tokens, kept in decoded text) and its chat template names them, as a reasoning model's does.
The weights are tiny's, so the model never writes a tag by itself; a prompt or `logit_bias`
puts them where a test needs them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from trtdisagg.api.reasoning import THINK_END, THINK_START
from trtdisagg.model.tiny import ensure_tiny_checkpoint

TAGS = {"<|reserved_0|>": THINK_START, "<|reserved_1|>": THINK_END}


def write_think_model(out: Path) -> Path:
    """The reasoning variant of the default tiny checkpoint, in `out`."""
    source = ensure_tiny_checkpoint()
    out.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        shutil.copy(file, out / file.name)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    for added in tokenizer["added_tokens"]:
        if added["content"] in TAGS:
            added["content"], added["special"] = TAGS[added["content"]], False
    vocab = tokenizer["model"]["vocab"]
    for old, new in TAGS.items():
        vocab[new] = vocab.pop(old)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] += "{#- a reasoning model thinks in <think> … </think> first -#}\n"
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out
