"""Synthetic models (`synthetic:NAME[@SEED]`): the directory, the fingerprint, seeded weights that
do not depend on the TP/PP split, and the 8B geometry. CPU only, on the small `llama3-mini`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trtdisagg.kv.cache import KVCache
from trtdisagg.kv.page_table import Layout
from trtdisagg.model.args import ModelArgs, ModelLoadError, model_fingerprint
from trtdisagg.model.batch import ForwardBatch, SeqSlice
from trtdisagg.model.llama import CausalLM
from trtdisagg.model.loader import load_model, resolve_model
from trtdisagg.model.parallel import Parallel
from trtdisagg.model.synthetic import SPECS, SyntheticModel, hf_config, parse
from trtdisagg.worker.tokenization import Tokenizer

MINI = "synthetic:llama3-mini"
CPU = torch.device("cpu")


def load(model_dir: Path, parallel: Parallel | None = None) -> CausalLM:
    return load_model(model_dir, dtype=torch.float32, device=CPU, parallel=parallel or Parallel())


def params(model: CausalLM) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def mini_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model(MINI, cache_dir=tmp_path_factory.mktemp("cache"))


def test_parse_names_and_seeds() -> None:
    assert parse("synthetic:llama3-8b") == SyntheticModel(
        name="llama3-8b", seed=0, spec=SPECS["llama3-8b"]
    )
    assert parse("synthetic:llama3-1b@7").seed == 7
    assert parse("synthetic:llama3-1b@7").model_value == "synthetic:llama3-1b@7"
    with pytest.raises(ModelLoadError, match=r"unknown synthetic model 'gpt9'; known: llama3-1b"):
        parse("synthetic:gpt9")
    with pytest.raises(ModelLoadError, match="seed 'x' is not an integer"):
        parse("synthetic:llama3-8b@x")
    with pytest.raises(ModelLoadError, match="not a synthetic"):
        parse("tiny")


def test_llama3_8b_geometry() -> None:
    args = ModelArgs.from_config(hf_config(parse("synthetic:llama3-8b")))
    assert (args.num_layers, args.hidden_size, args.num_heads, args.num_kv_heads) == (
        32,
        4096,
        32,
        8,
    )
    assert (args.head_dim, args.intermediate_size, args.vocab_size) == (128, 14336, 128256)
    assert args.rope_scaling is not None and args.rope_scaling.factor == 8.0
    assert args.rope_theta == 500000.0
    assert not args.tie_word_embeddings
    kv_bytes_per_token = KVCache.bytes_per_block(
        num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=1, dtype=torch.bfloat16
    )
    assert kv_bytes_per_token == 131072  # 128 KiB, the figure the benchmarks use
    one_b = ModelArgs.from_config(hf_config(parse("synthetic:llama3-1b")))
    assert (one_b.num_layers, one_b.hidden_size, one_b.head_dim) == (16, 2048, 64)
    assert one_b.tie_word_embeddings


def test_directory_is_a_weightless_checkpoint(mini_dir: Path, tmp_path: Path) -> None:
    spec = SPECS["llama3-mini"]
    assert not list(mini_dir.glob("*.safetensors"))
    args = ModelArgs.from_dir(mini_dir)
    assert (args.num_layers, args.hidden_size, args.vocab_size) == (
        spec.num_layers,
        spec.hidden_size,
        spec.vocab_size,
    )
    tokenizer = Tokenizer.from_dir(mini_dir)
    assert tokenizer.vocab_size == spec.vocab_size
    ids = tokenizer.encode("The quick brown fox")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The quick brown fox"
    # Written once: a second resolve returns the same directory untouched.
    stamp = (mini_dir / "config.json").stat().st_mtime_ns
    assert resolve_model(MINI, cache_dir=mini_dir.parent) == mini_dir
    assert (mini_dir / "config.json").stat().st_mtime_ns == stamp


def test_fingerprint_depends_on_spec_and_seed_only(mini_dir: Path, tmp_path: Path) -> None:
    again = resolve_model(MINI, cache_dir=tmp_path / "elsewhere")
    assert again != mini_dir
    assert model_fingerprint(again) == model_fingerprint(mini_dir)
    other_seed = resolve_model(MINI + "@1", cache_dir=tmp_path)
    assert model_fingerprint(other_seed) != model_fingerprint(mini_dir)
    other_spec = resolve_model("synthetic:llama3-8b", cache_dir=tmp_path)  # no weights: cheap
    assert model_fingerprint(other_spec) != model_fingerprint(mini_dir)


def test_weights_are_seeded_and_scaled(mini_dir: Path, tmp_path: Path) -> None:
    first, second = params(load(mini_dir)), params(load(mini_dir))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    reseeded = params(load(resolve_model(MINI + "@1", cache_dir=tmp_path)))
    assert not torch.equal(first["lm_head.weight"], reseeded["lm_head.weight"])
    spec = SPECS["llama3-mini"]
    down = first["model.layers.0.mlp.down_proj.weight"]
    assert down.std().item() == pytest.approx(spec.intermediate_size**-0.5, rel=0.05)
    norm = first["model.layers.1.input_layernorm.weight"]
    assert norm.mean().item() == pytest.approx(1.0, abs=0.05)
    assert not torch.equal(norm, torch.ones_like(norm))


def test_tp_and_pp_ranks_hold_slices_of_the_same_weights(mini_dir: Path) -> None:
    whole = params(load(mini_dir))
    halves = [params(load(mini_dir, Parallel(tp_rank=r, tp_size=2))) for r in range(2)]
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight"):
        assert torch.equal(torch.cat([h[name] for h in halves], dim=0), whole[name])
    name = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([h[name] for h in halves], dim=1), whole[name])
    last_stage = params(load(mini_dir, Parallel(pp_rank=1, pp_size=2)))
    # Stage 1 holds global layer 1 as its local layer 0.
    local = last_stage["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(local, whole["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(last_stage["lm_head.weight"], whole["lm_head.weight"])


def test_forward_gives_spread_logits(mini_dir: Path) -> None:
    model = load(mini_dir)
    args = model.args
    cache = KVCache(
        num_blocks=4,
        num_layers=args.num_layers,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        tokens_per_block=16,
        layout=Layout.HND,
        dtype=torch.float32,
        device=CPU,
    )
    n = 20
    batch = ForwardBatch(
        input_ids=torch.arange(5, 5 + n),
        positions=torch.arange(n),
        slot_mapping=torch.arange(n),
        seqs=(SeqSlice(q_start=0, q_len=n, kv_len=n, block_ids=torch.tensor([0, 1])),),
        logits_indices=torch.tensor([n - 1]),
    )
    with torch.inference_mode():
        logits = model(batch, cache)
    assert logits.shape == (1, args.vocab_size)
    assert torch.isfinite(logits).all()
    spread = logits.std().item()
    assert 0.5 * SPECS["llama3-mini"].logit_std < spread < 2 * SPECS["llama3-mini"].logit_std
    top = torch.topk(logits[0], 2).values
    assert (top[0] - top[1]).item() > 0  # not a degenerate, flat distribution
