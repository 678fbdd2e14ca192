"""ModelArgs: the shape of a Llama-family model, read from a Hugging Face `config.json`.

Only what the forward pass needs is kept, and everything we cannot run faithfully (sliding
windows, unknown RoPE variants, MLP biases, activations other than SiLU) is refused here, at load
time, with a message naming the key. Both config dialects are read: the older `rope_theta` +
`rope_scaling` keys and transformers 5's `rope_parameters`.

`model_fingerprint` hashes the config and the safetensors headers (not the weights: reading them
would cost seconds per GB); ctx and gen peers compare it to refuse mismatched checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any, Final

import attrs

SUPPORTED_ARCHITECTURES: Final = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# Marks a synthetic model directory (`trtdisagg.model.synthetic`): weights are drawn at load
# time, and the fingerprint hashes this file instead of safetensors headers.
SYNTHETIC_SPEC_FILE: Final = "synthetic.json"

# Keys that say which program wrote the file, not what the model is.
_PROVENANCE_KEYS: Final = frozenset({"transformers_version", "_name_or_path"})


class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded: missing file or tensor, unsupported architecture or key."""


@attrs.frozen(kw_only=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@attrs.frozen(kw_only=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool  # bias on q/k/v projections (always on for Qwen2)
    o_proj_bias: bool  # bias on o_proj (Llama/Qwen3 `attention_bias`; never for Qwen2)
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before RoPE
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim {self.head_dim} must be even for RoPE")

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelArgs:
        return cls.from_config(read_config(model_dir), source=str(model_dir / "config.json"))

    @classmethod
    def from_config(cls, config: dict[str, Any], *, source: str = "config.json") -> ModelArgs:
        """Build from a parsed config.json.

        Raises:
            ModelLoadError: unsupported architecture, RoPE type, activation or attention variant,
                or a required key missing; the message names `source` and the key.
        """
        architecture = _architecture(config, source)
        _refuse_unsupported(config, source)

        def need(key: str) -> Any:
            if key not in config:
                raise ModelLoadError(f"{source}: missing required key {key!r}")
            return config[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        rope_theta, rope_scaling = _rope(config, source)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            # HF's default is True when the key is absent.
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            attention_bias=is_qwen2 or attention_bias,
            o_proj_bias=(not is_qwen2) and attention_bias,
            qk_norm=architecture == "Qwen3ForCausalLM",
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_as_ids(config.get("eos_token_id")),
        )


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: config.json not found")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return config


def _architecture(config: dict[str, Any], source: str) -> str:
    architectures = config.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported architecture {architectures!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(architectures[0])


def _refuse_unsupported(config: dict[str, Any], source: str) -> None:
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise ModelLoadError(f"{source}: hidden_act {activation!r} unsupported (only 'silu')")
    if config.get("mlp_bias"):
        raise ModelLoadError(f"{source}: mlp_bias true is unsupported")
    if config.get("use_sliding_window"):
        raise ModelLoadError(f"{source}: use_sliding_window true is unsupported")
    layer_types = set(config.get("layer_types") or ())
    if layer_types - {"full_attention"}:
        raise ModelLoadError(
            f"{source}: layer_types {sorted(layer_types)} unsupported (only 'full_attention')"
        )


def _rope(config: dict[str, Any], source: str) -> tuple[float, Llama3RopeScaling | None]:
    # transformers 5 folds rope_theta into rope_parameters; older configs keep them apart.
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor != 1 is unsupported")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ModelLoadError(
            f"{source}: rope type {kind!r} unsupported; supported: 'default', 'llama3'"
        )
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as error:
        raise ModelLoadError(f"{source}: llama3 rope scaling lacks {error.args[0]!r}") from None
    return theta, scaling


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def model_fingerprint(model_dir: Path) -> str:
    """A stable hex digest of the model's identity: config.json plus every tensor's
    (name, shape, dtype) from the safetensors headers.

    Tensors are hashed by name across all files, so a sharded and an unsharded copy of the same
    checkpoint agree. Of the weight values, only the first and last 64 bytes of each tensor are
    read: enough to tell two same-shaped checkpoints apart, cheap for a 16 GB one. A synthetic
    model (no weight files) hashes its `synthetic.json` (spec and seed) instead: the same spec
    and seed give the same weights.
    """
    config = {k: v for k, v in read_config(model_dir).items() if k not in _PROVENANCE_KEYS}
    synthetic = model_dir / SYNTHETIC_SPEC_FILE
    if synthetic.is_file():
        payload = json.dumps({"config": config, "synthetic": json.loads(synthetic.read_text())},
                             sort_keys=True)  # fmt: skip
        return hashlib.sha256(payload.encode()).hexdigest()
    tensors: dict[str, tuple[list[int], str, str]] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors files")
    for file in files:
        header = _safetensors_header(file)
        data_start = 8 + _header_length(file)
        with file.open("rb") as f:
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                sample = _value_sample(f, data_start, entry["data_offsets"])
                tensors[name] = (list(entry["shape"]), str(entry["dtype"]), sample)
    payload = json.dumps({"config": config, "tensors": tensors}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def _header_length(path: Path) -> int:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
    return int(length)


def _value_sample(f: Any, data_start: int, offsets: list[int]) -> str:
    start, end = data_start + int(offsets[0]), data_start + int(offsets[1])
    f.seek(start)
    head = f.read(min(64, end - start))
    f.seek(max(start, end - 64))
    tail = f.read(min(64, end - start))
    return (head + tail).hex()


def _safetensors_header(path: Path) -> dict[str, Any]:
    # Format: u64 little-endian header length, then that many bytes of JSON.
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ModelLoadError(f"{path}: truncated safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelLoadError(f"{path}: corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors header")
    return header
