"""The embedded default model `tiny`, and the writer behind `tools/make_tiny_model.py`.

A tiny checkpoint is a real Hugging Face checkpoint (config.json, safetensors, tokenizer files,
generation_config.json) with seeded random weights, so every code path that serves a downloaded
model serves it too, and `transformers` can act as the correctness oracle on it. Weights are drawn
with a std large enough that greedy logits have clear top-2 margins: near-uniform logits would make
the oracle comparison stop at the first near-tie.

`ensure_tiny_checkpoint` writes the default once per parameter set into a directory named by their
hash; it writes into a temporary sibling and renames it into place, so processes racing to create
it all end up reading one complete copy.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Final

import attrs
import torch
from safetensors.torch import save_file

from trtdisagg.model.cache_dir import default_cache_dir, write_once
from trtdisagg.model.tiny_tokenizer import (
    BOS,
    END_OF_TURN,
    EOS,
    PAD,
    special_token_id,
    write_tokenizer_files,
)

# Bump when the files written for the same TinySpec change, so old caches are not reused.
WRITER_VERSION: Final = 2
ARCHITECTURES: Final = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
DTYPES: Final = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@attrs.frozen(kw_only=True)
class TinySpec:
    arch: str = attrs.field(default="llama", validator=attrs.validators.in_(ARCHITECTURES))
    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    intermediate_size: int = 384
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_llama3: bool = False
    tie_word_embeddings: bool = False
    seed: int = 0
    dtype: str = attrs.field(default="float32", validator=attrs.validators.in_(DTYPES))
    init_std: float = 0.2
    shards: int = 1

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def digest(self) -> str:
        payload = json.dumps([WRITER_VERSION, attrs.asdict(self)], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def ensure_tiny_checkpoint(cache_dir: Path | None = None, spec: TinySpec | None = None) -> Path:
    """The default tiny checkpoint's directory, writing it first if needed.

    Args:
        cache_dir: parent directory; default `$TRTDISAGG_CACHE_DIR`, else `~/.cache/trtdisagg`.
        spec: the checkpoint's parameters; default `TinySpec()`.

    Returns:
        `<cache_dir>/tiny-<hash of spec>`, complete.
    """
    spec = spec or TinySpec()
    final = (cache_dir or default_cache_dir()) / f"tiny-{spec.digest()}"
    return write_once(final, lambda scratch: write_checkpoint(spec, scratch))


def write_checkpoint(spec: TinySpec, out_dir: Path) -> None:
    """Write a complete HF checkpoint for `spec` into `out_dir` (created if missing)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(hf_config(spec), indent=2) + "\n")
    generation = {
        "bos_token_id": special_token_id(BOS),
        "eos_token_id": [special_token_id(EOS), special_token_id(END_OF_TURN)],
        "pad_token_id": special_token_id(PAD),
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer_files(out_dir, spec.vocab_size, model_max_length=spec.max_position_embeddings)
    _write_weights(random_weights(spec), out_dir, spec.shards)


def hf_config(spec: TinySpec) -> dict[str, object]:
    """config.json in the (pre-transformers-5) dialect that every transformers version reads."""
    architecture, model_type = ARCHITECTURES[spec.arch]
    config: dict[str, object] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": False,
        "bos_token_id": special_token_id(BOS),
        "eos_token_id": special_token_id(EOS),
        "pad_token_id": special_token_id(PAD),
        "torch_dtype": spec.dtype,
        "initializer_range": spec.init_std,
    }
    if spec.rope_llama3:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # Small, so the scaled band covers frequencies that short test prompts exercise.
            "original_max_position_embeddings": 64,
        }
    if spec.arch != "llama":
        config.update(
            use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_layers
        )
    return config


def random_weights(spec: TinySpec) -> dict[str, torch.Tensor]:
    """Seeded weights under HF's parameter names, in a fixed order."""
    generator = torch.Generator().manual_seed(spec.seed)
    dtype = DTYPES[spec.dtype]
    h, d, i = spec.hidden_size, spec.resolved_head_dim, spec.intermediate_size

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * spec.init_std).to(dtype)

    def norm_weight(dim: int) -> torch.Tensor:
        # Not all ones: a norm weight the loader forgot would then change the tokens.
        return (1.0 + 0.1 * torch.randn(dim, generator=generator)).to(dtype)

    weights = {"model.embed_tokens.weight": normal(spec.vocab_size, h)}
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        weights[p + "input_layernorm.weight"] = norm_weight(h)
        weights[p + "self_attn.q_proj.weight"] = normal(spec.num_heads * d, h)
        weights[p + "self_attn.k_proj.weight"] = normal(spec.num_kv_heads * d, h)
        weights[p + "self_attn.v_proj.weight"] = normal(spec.num_kv_heads * d, h)
        if spec.arch == "qwen2":
            weights[p + "self_attn.q_proj.bias"] = normal(spec.num_heads * d)
            weights[p + "self_attn.k_proj.bias"] = normal(spec.num_kv_heads * d)
            weights[p + "self_attn.v_proj.bias"] = normal(spec.num_kv_heads * d)
        if spec.arch == "qwen3":
            weights[p + "self_attn.q_norm.weight"] = norm_weight(d)
            weights[p + "self_attn.k_norm.weight"] = norm_weight(d)
        weights[p + "self_attn.o_proj.weight"] = normal(h, spec.num_heads * d)
        weights[p + "post_attention_layernorm.weight"] = norm_weight(h)
        weights[p + "mlp.gate_proj.weight"] = normal(i, h)
        weights[p + "mlp.up_proj.weight"] = normal(i, h)
        weights[p + "mlp.down_proj.weight"] = normal(h, i)
    weights["model.norm.weight"] = norm_weight(h)
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = normal(spec.vocab_size, h)
    return weights


def _write_weights(weights: dict[str, torch.Tensor], out_dir: Path, shards: int) -> None:
    metadata = {"format": "pt"}
    if shards <= 1:
        save_file(weights, str(out_dir / "model.safetensors"), metadata=metadata)
        return
    names = list(weights)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    # Consecutive names, cut by cumulative bytes, so each shard holds whole nearby layers.
    seen = 0
    for name in names:
        size = weights[name].numel() * weights[name].element_size()
        groups[min(shards - 1, seen * shards // total)].append(name)
        seen += size
    weight_map: dict[str, str] = {}
    for index, group in enumerate(groups, start=1):
        file = f"model-{index:05d}-of-{shards:05d}.safetensors"
        save_file(
            {n: weights[n].contiguous() for n in group}, str(out_dir / file), metadata=metadata
        )
        weight_map.update(dict.fromkeys(group, file))
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
