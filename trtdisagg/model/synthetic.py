"""Synthetic models: a real model's geometry with seeded random weights made on the device.

`model: synthetic:llama3-8b` serves the Llama-3.1-8B shape (32 layers, hidden 4096, 32 heads over
8 kv heads, intermediate 14336, vocab 128256, llama3 RoPE) without a checkpoint: no 16 GB file
is written or read. `synthetic:NAME@SEED` picks another seed (default 0). Names: `SPECS`.

`ensure_synthetic_dir` writes, once per (spec, seed), a small directory that looks like a
checkpoint without weights: config.json, generation_config.json, the tiny byte-level BPE
tokenizer padded to the model's vocabulary (`tiny_tokenizer`), and `synthetic.json` (the spec
and seed). So everything that reads a model directory (the tokenizer, `ModelArgs.from_dir`, the
coordinator's prompt tokenizer) works unchanged, and `model_fingerprint` hashes `synthetic.json`
in place of the safetensors headers: ctx and gen agree exactly when spec and seed agree.

`load_model` sees `synthetic.json` and fills each parameter with `synthetic_tensor`: a tensor
drawn on the target device from a generator seeded by (seed, the parameter's global HF name), so
the weights do not depend on the load order, on the pipeline stage or on the TP split (a TP rank
draws the whole tensor and keeps its slice). Linear weights have std `init_gain / sqrt(fan_in)`
(unit-scale activations at any width, so attention is far from uniform), norms `1 + 0.1 N(0,1)`,
and the output head is scaled so logits have std `logit_std`: random models otherwise have tiny
top-2 margins over a large vocabulary and greedy comparisons would stop at the first near-tie.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Any, Final

import attrs
import torch

from trtdisagg.model.args import SYNTHETIC_SPEC_FILE, ModelArgs, ModelLoadError
from trtdisagg.model.cache_dir import default_cache_dir, write_once
from trtdisagg.model.tiny_tokenizer import (
    BOS,
    END_OF_TURN,
    EOS,
    PAD,
    special_token_id,
    write_tokenizer_files,
)

PREFIX: Final = "synthetic:"
# Bump when the files written for the same spec change, so old caches are not reused.
WRITER_VERSION: Final = 1


@attrs.frozen(kw_only=True)
class SyntheticSpec:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 500000.0
    # Llama 3.x RoPE scaling (factor, low_freq_factor, high_freq_factor, original max positions)
    rope_llama3: tuple[float, float, float, int] | None = (8.0, 1.0, 4.0, 8192)
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    init_gain: float = 1.0
    logit_std: float = 8.0


SPECS: Final[dict[str, SyntheticSpec]] = {
    # Llama-3.1-8B
    "llama3-8b": SyntheticSpec(
        num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
    ),
    # Llama-3.2-1B (tied embeddings, RoPE factor 32)
    "llama3-1b": SyntheticSpec(
        num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64,
        intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
        rope_llama3=(32.0, 1.0, 4.0, 8192), tie_word_embeddings=True,
    ),
    # A CPU-sized model with the same structure, for tests. The scaled RoPE band starts at 64
    # positions, so short test prompts exercise it.
    "llama3-mini": SyntheticSpec(
        num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
        intermediate_size=512, vocab_size=1024, max_position_embeddings=4096,
        rope_llama3=(8.0, 1.0, 4.0, 64),
    ),
}  # fmt: skip


@attrs.frozen(kw_only=True)
class SyntheticModel:
    """A parsed `synthetic:NAME[@SEED]` model value."""

    name: str
    seed: int
    spec: SyntheticSpec

    @property
    def model_value(self) -> str:
        return f"{PREFIX}{self.name}" + (f"@{self.seed}" if self.seed else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "writer_version": WRITER_VERSION,
            "name": self.name,
            "seed": self.seed,
            "spec": attrs.asdict(self.spec),
        }

    def digest(self) -> str:
        payload = json.dumps(self.to_json(), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def is_synthetic(model: str) -> bool:
    return model.startswith(PREFIX)


def parse(model: str) -> SyntheticModel:
    """`synthetic:NAME` or `synthetic:NAME@SEED`.

    Raises:
        ModelLoadError: not a synthetic value, an unknown name, or a seed that is not an integer.
    """
    if not is_synthetic(model):
        raise ModelLoadError(f"model {model!r}: not a {PREFIX}NAME value")
    name, _, seed_text = model[len(PREFIX) :].partition("@")
    spec = SPECS.get(name)
    if spec is None:
        raise ModelLoadError(
            f"model {model!r}: unknown synthetic model {name!r}; known: {', '.join(sorted(SPECS))}"
        )
    try:
        seed = int(seed_text) if seed_text else 0
    except ValueError:
        raise ModelLoadError(f"model {model!r}: seed {seed_text!r} is not an integer") from None
    if not 0 <= seed < 2**31:
        raise ModelLoadError(f"model {model!r}: seed must be in [0, 2**31)")
    return SyntheticModel(name=name, seed=seed, spec=spec)


def hf_config(model: SyntheticModel) -> dict[str, Any]:
    spec = model.spec
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": special_token_id(BOS),
        "eos_token_id": special_token_id(EOS),
        "pad_token_id": special_token_id(PAD),
        "torch_dtype": "bfloat16",
    }
    if spec.rope_llama3 is not None:
        factor, low, high, original = spec.rope_llama3
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
    return config


def ensure_synthetic_dir(model: str, cache_dir: Path | None = None) -> Path:
    """The directory of a `synthetic:` model value, written first if needed (no weights)."""
    parsed = parse(model)
    cache_dir = cache_dir or default_cache_dir()
    final = cache_dir / f"synthetic-{parsed.name}-s{parsed.seed}-{parsed.digest()}"
    return write_once(final, lambda scratch: _write(parsed, scratch))


def _write(model: SyntheticModel, out_dir: Path) -> None:
    spec = model.spec
    (out_dir / "config.json").write_text(json.dumps(hf_config(model), indent=2) + "\n")
    generation = {
        "bos_token_id": special_token_id(BOS),
        "eos_token_id": [special_token_id(EOS), special_token_id(END_OF_TURN)],
        "pad_token_id": special_token_id(PAD),
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer_files(out_dir, spec.vocab_size, model_max_length=spec.max_position_embeddings)
    (out_dir / SYNTHETIC_SPEC_FILE).write_text(json.dumps(model.to_json(), indent=2) + "\n")


def read_synthetic(model_dir: Path) -> SyntheticModel | None:
    """The synthetic model a directory stands for, or None for a real checkpoint."""
    path = model_dir / SYNTHETIC_SPEC_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        fields: dict[str, Any] = dict(data["spec"])
        if fields.get("rope_llama3") is not None:
            fields["rope_llama3"] = tuple(fields["rope_llama3"])
        spec = SyntheticSpec(**fields)
        return SyntheticModel(name=str(data["name"]), seed=int(data["seed"]), spec=spec)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise ModelLoadError(f"{path}: not a valid synthetic model spec ({error})") from None


def hf_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter's global (unsharded) shape under its Hugging Face name."""
    h, d, i = args.hidden_size, args.head_dim, args.intermediate_size
    q, kv = args.num_heads * d, args.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (args.vocab_size, h)}
    for layer in range(args.num_layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (args.vocab_size, h)
    return shapes


def synthetic_tensor(
    model: SyntheticModel,
    name: str,
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The whole tensor `name` (a global HF name) of `model`, drawn on `device`."""
    spec = model.spec
    generator = torch.Generator(device=device)
    # 32 bits: the CPU generator (mt19937) ignores the high half of a 64-bit seed.
    generator.manual_seed(zlib.crc32(f"{model.seed}:{name}".encode()))
    out = torch.empty(shape, dtype=dtype, device=device)
    if name.endswith("norm.weight"):
        # Not all ones: a norm weight the loader forgot would then change the tokens.
        return out.normal_(1.0, 0.1, generator=generator)
    if name == "model.embed_tokens.weight":
        # Tied: the table is also the output head, so it carries the logit scale.
        std = spec.logit_std / shape[1] ** 0.5 if spec.tie_word_embeddings else 1.0
    elif name == "lm_head.weight":
        std = spec.logit_std / shape[1] ** 0.5
    else:
        std = spec.init_gain / shape[1] ** 0.5
    return out.normal_(0.0, std, generator=generator)
