"""Write a tiny random-weight Hugging Face checkpoint (Llama, Qwen2 or Qwen3) into DIR.

    python tools/make_tiny_model.py /tmp/tiny-qwen3 --arch qwen3 --head-dim 64 --shards 3

The files are what `transformers` would save (config.json, safetensors, tokenizer files,
generation_config.json), written without importing it. Same arguments, same bytes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trtdisagg.model.tiny import ARCHITECTURES, DTYPES, TinySpec, write_checkpoint


def parse_args(argv: list[str] | None = None) -> tuple[Path, TinySpec]:
    defaults = TinySpec()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dir", type=Path, help="output directory (created)")
    p.add_argument("--arch", choices=sorted(ARCHITECTURES), default=defaults.arch)
    p.add_argument("--layers", type=int, default=defaults.num_layers)
    p.add_argument("--hidden", type=int, default=defaults.hidden_size)
    p.add_argument("--heads", type=int, default=defaults.num_heads)
    p.add_argument("--kv-heads", type=int, default=defaults.num_kv_heads)
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    p.add_argument("--intermediate", type=int, default=defaults.intermediate_size)
    p.add_argument("--vocab", type=int, default=defaults.vocab_size)
    p.add_argument("--max-positions", type=int, default=defaults.max_position_embeddings)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=defaults.dtype)
    p.add_argument("--init-std", type=float, default=defaults.init_std)
    p.add_argument(
        "--tie",
        action=argparse.BooleanOptionalAction,
        default=defaults.tie_word_embeddings,
        help="tie lm_head to the embeddings (lm_head.weight is then not written)",
    )
    p.add_argument("--rope-llama3", action="store_true", help="llama3 RoPE scaling")
    p.add_argument("--shards", type=int, default=1, help="N > 1: sharded, with an index file")
    a = p.parse_args(argv)
    spec = TinySpec(
        arch=a.arch,
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_heads=a.heads,
        num_kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        intermediate_size=a.intermediate,
        vocab_size=a.vocab,
        max_position_embeddings=a.max_positions,
        rope_llama3=a.rope_llama3,
        tie_word_embeddings=a.tie,
        seed=a.seed,
        dtype=a.dtype,
        init_std=a.init_std,
        shards=a.shards,
    )
    return a.dir, spec


def main(argv: list[str] | None = None) -> None:
    out_dir, spec = parse_args(argv)
    write_checkpoint(spec, out_dir)
    print(f"wrote a {spec.num_layers}-layer {spec.arch} checkpoint to {out_dir}")


if __name__ == "__main__":
    main()
