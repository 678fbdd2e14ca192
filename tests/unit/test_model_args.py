"""ModelArgs from config.json, the fingerprint, Parallel's splits, the loader's errors, and the
tiny checkpoint writer (no transformers needed here)."""

from __future__ import annotations

import importlib.util
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors.torch import load_file, save_file

from trtdisagg.model.args import Llama3RopeScaling, ModelArgs, ModelLoadError, model_fingerprint
from trtdisagg.model.loader import load_model, resolve_model
from trtdisagg.model.parallel import Parallel, pp_layer_range
from trtdisagg.model.rope import inv_frequencies
from trtdisagg.model.tiny import TinySpec, ensure_tiny_checkpoint, hf_config, write_checkpoint

SMALL = TinySpec(num_layers=2, hidden_size=64, intermediate_size=96, vocab_size=300)


def config(**overrides: Any) -> dict[str, Any]:
    return {**hf_config(SMALL), **overrides}


def test_llama_config_old_dialect_with_llama3_rope() -> None:
    args = ModelArgs.from_config(
        config(rope_scaling=hf_config(TinySpec(rope_llama3=True))["rope_scaling"])
    )
    assert args.architecture == "LlamaForCausalLM"
    assert (args.num_layers, args.hidden_size, args.num_heads, args.num_kv_heads) == (2, 64, 4, 2)
    assert args.head_dim == 16
    assert args.rope_scaling == Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    assert not args.attention_bias
    assert not args.qk_norm
    assert args.bos_token_id == 1
    assert args.eos_token_ids == (2,)


def test_transformers5_rope_parameters_dialect() -> None:
    raw = config(eos_token_id=[2, 6], head_dim=None)
    del raw["rope_theta"], raw["rope_scaling"], raw["head_dim"]
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    args = ModelArgs.from_config(raw)
    assert args.rope_theta == 500000.0
    assert args.rope_scaling is None
    assert args.head_dim == 16  # hidden / heads when head_dim is absent
    assert args.eos_token_ids == (2, 6)


def test_qwen_variants() -> None:
    qwen2 = ModelArgs.from_config(config(architectures=["Qwen2ForCausalLM"]))
    assert qwen2.attention_bias
    assert not qwen2.o_proj_bias
    assert not qwen2.qk_norm
    qwen3 = ModelArgs.from_config(config(architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert qwen3.qk_norm
    assert qwen3.head_dim == 32
    assert not qwen3.attention_bias
    llama_bias = ModelArgs.from_config(config(attention_bias=True))
    assert llama_bias.attention_bias
    assert llama_bias.o_proj_bias


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"architectures": ["MistralForCausalLM"]},
            r"unsupported architecture \['MistralForCausalLM'\]; "
            r"supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' unsupported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 4.0}}, "llama3 rope scaling lacks"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' unsupported"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ],
)
def test_refused_configs(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        ModelArgs.from_config(config(**overrides))


def test_missing_key_is_named() -> None:
    raw = config()
    del raw["hidden_size"]
    with pytest.raises(ModelLoadError, match="missing required key 'hidden_size'"):
        ModelArgs.from_config(raw)


def test_llama3_scaling_changes_low_frequencies_only() -> None:
    plain = inv_frequencies(64, 10000.0, None, device=torch.device("cpu"))
    scaling = Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    scaled = inv_frequencies(64, 10000.0, scaling, device=torch.device("cpu"))
    assert torch.equal(scaled[:2], plain[:2])  # short wavelengths untouched
    assert torch.allclose(scaled[-1], plain[-1] / 8)  # long ones slowed by `factor`


def test_pp_layer_range_is_an_even_cover() -> None:
    assert [pp_layer_range(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    assert [pp_layer_range(7, 3, r) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ValueError, match="2 layers cannot be split over 3"):
        pp_layer_range(2, 3, 0)


def test_kv_heads_split_or_duplicated() -> None:
    assert [Parallel(tp_rank=r, tp_size=2).kv_head_range(4) for r in range(2)] == [(0, 2), (2, 4)]
    assert [Parallel(tp_rank=r, tp_size=4).kv_head_range(2) for r in range(4)] == [
        (0, 1),
        (0, 1),
        (1, 2),
        (1, 2),
    ]
    with pytest.raises(ValueError, match="not a multiple"):
        Parallel(tp_rank=0, tp_size=4).kv_head_range(3)
    with pytest.raises(ValueError, match="tp_rank 2 outside"):
        Parallel(tp_rank=2, tp_size=2)


@pytest.fixture
def small_ckpt(tmp_path: Path) -> Path:
    write_checkpoint(SMALL, tmp_path / "m")
    return tmp_path / "m"


def test_fingerprint_is_stable_and_sensitive(small_ckpt: Path, tmp_path: Path) -> None:
    fingerprint = model_fingerprint(small_ckpt)
    assert fingerprint == model_fingerprint(small_ckpt)
    write_checkpoint(attrs.evolve(SMALL, shards=2), tmp_path / "sharded")
    assert model_fingerprint(tmp_path / "sharded") == fingerprint  # same tensors, other files
    write_checkpoint(attrs.evolve(SMALL, dtype="bfloat16"), tmp_path / "bf16")
    assert model_fingerprint(tmp_path / "bf16") != fingerprint
    write_checkpoint(attrs.evolve(SMALL, num_layers=3), tmp_path / "deeper")
    assert model_fingerprint(tmp_path / "deeper") != fingerprint


def load(path: Path) -> None:
    load_model(path, dtype=torch.float32, device=torch.device("cpu"), parallel=Parallel())


def test_load_unsupported_architecture(small_ckpt: Path) -> None:
    raw = json.loads((small_ckpt / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (small_ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        load(small_ckpt)


def test_load_missing_safetensors(small_ckpt: Path) -> None:
    (small_ckpt / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors files"):
        load(small_ckpt)


def test_load_missing_shard_file(tmp_path: Path) -> None:
    write_checkpoint(attrs.evolve(SMALL, shards=2), tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        ModelLoadError, match=r"lists model-00002-of-00002\.safetensors, which does not exist"
    ):
        load(tmp_path)


def test_load_missing_tensor(small_ckpt: Path) -> None:
    weights = load_file(str(small_ckpt / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(small_ckpt / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' not found"
    ):
        load(small_ckpt)


def test_load_wrong_shape(small_ckpt: Path) -> None:
    weights = load_file(str(small_ckpt / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(65)
    save_file(weights, str(small_ckpt / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"'model.norm.weight' slice has shape \(65,\), expected \(64,\)"
    ):
        load(small_ckpt)


def test_load_fills_every_parameter_exactly(small_ckpt: Path) -> None:
    model = load_model(
        small_ckpt, dtype=torch.float32, device=torch.device("cpu"), parallel=Parallel()
    )
    weights = load_file(str(small_ckpt / "model.safetensors"))
    params = dict(model.named_parameters())
    assert set(params) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(params[name], tensor), name


def test_resolve_model(small_ckpt: Path, tmp_path: Path) -> None:
    assert resolve_model(str(small_ckpt)) == small_ckpt
    with pytest.raises(ModelLoadError, match="not 'tiny' and not a directory"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match=r"config\.json not found"):
        resolve_model(str(tmp_path))
    tiny = resolve_model("tiny", cache_dir=tmp_path / "cache")
    assert tiny.name.startswith("tiny-")
    assert (tiny / "tokenizer.json").is_file()
    assert ModelArgs.from_dir(tiny).num_layers == 4


def test_tiny_writer_is_deterministic(tmp_path: Path) -> None:
    write_checkpoint(SMALL, tmp_path / "a")
    write_checkpoint(SMALL, tmp_path / "b")
    for file in sorted(p.name for p in (tmp_path / "a").iterdir()):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file


def test_ensure_tiny_checkpoint_races_to_one_copy(tmp_path: Path) -> None:
    # Threads race through the same mkdtemp + rename path that processes would.
    start = threading.Barrier(4)

    def ensure() -> Path:
        start.wait()
        return ensure_tiny_checkpoint(tmp_path, SMALL)

    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: ensure(), range(4)))
    assert len(set(paths)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]  # no scratch left over
    assert ensure_tiny_checkpoint(tmp_path, SMALL) == paths[0]
    ModelArgs.from_dir(paths[0])


def test_make_tiny_model_tool(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "make_tiny_model", Path(__file__).parents[2] / "tools" / "make_tiny_model.py"
    )
    assert spec is not None
    assert spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    argv = [str(tmp_path), "--arch", "qwen3", "--layers", "2", "--hidden", "64", "--heads", "2"]
    argv += ["--kv-heads", "1", "--head-dim", "48", "--vocab", "300", "--tie", "--shards", "2"]
    argv += ["--rope-llama3", "--dtype", "bfloat16"]
    tool.main(argv)
    args = ModelArgs.from_dir(tmp_path)
    assert args.architecture == "Qwen3ForCausalLM"
    assert (args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim) == (2, 2, 1, 48)
    assert args.tie_word_embeddings
    assert args.rope_scaling is not None
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    model = load_model(
        tmp_path, dtype=torch.float32, device=torch.device("cpu"), parallel=Parallel()
    )
    assert model.lm_head is not None
    assert model.model.embed_tokens is not None
    assert model.lm_head.weight is model.model.embed_tokens.weight
