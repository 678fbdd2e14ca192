"""Our CausalLM over a paged cache gives transformers' greedy tokens (DESIGN.md §10).

Checkpoints are written by transformers itself with random weights; ours is driven by
`PagedGreedy` (tests/oracle.py), which builds ForwardBatches the way the runner does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from tests.oracle import PagedGreedy, Seq, assert_greedy_match, hf_greedy, make_hf_checkpoint
from trtdisagg.kv.page_table import Layout
from trtdisagg.model.args import ModelArgs
from trtdisagg.model.llama import CausalLM
from trtdisagg.model.loader import load_model
from trtdisagg.model.parallel import Parallel
from trtdisagg.model.tiny import TinySpec, ensure_tiny_checkpoint

pytest.importorskip("transformers")

PROMPT = [(7 * i + 3) % 300 + 7 for i in range(37)]  # odd length: crosses block boundaries
NEW_TOKENS = 16

CHECKPOINTS: dict[str, dict[str, Any]] = {
    # llama: untied, llama3 RoPE scaling, sharded (index + several files)
    "llama": {"arch": "llama", "rope_llama3": True, "max_shard_size": "100KB"},
    "llama_tied": {"arch": "llama", "tie_word_embeddings": True, "num_kv_heads": 1},
    "qwen2": {"arch": "qwen2", "tie_word_embeddings": True},  # q/k/v biases
    "qwen3": {"arch": "qwen3", "head_dim": 32},  # q/k norm, head_dim != hidden / heads
}


@attrs.frozen(kw_only=True)
class Reference:
    path: Path
    tokens: list[int]
    margins: list[float]


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Reference:
    path = make_hf_checkpoint(tmp_path_factory.mktemp(request.param), **CHECKPOINTS[request.param])
    tokens, margins = hf_greedy(path, PROMPT, NEW_TOKENS)
    return Reference(path=path, tokens=tokens, margins=margins)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("llama_mix"), "llama", num_layers=3)


def load(path: Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    return load_model(path, dtype=dtype, device=torch.device("cpu"), parallel=Parallel())


@pytest.mark.parametrize(("layout", "tokens_per_block"), [(Layout.HND, 4), (Layout.NHD, 8)])
def test_greedy_matches_hf_with_chunked_prefill(
    checkpoint: Reference, layout: Layout, tokens_per_block: int
) -> None:
    driver = PagedGreedy.single(
        load(checkpoint.path), layout=layout, tokens_per_block=tokens_per_block
    )
    ours = driver.generate(PROMPT, NEW_TOKENS, chunks=(5, 11, 9))  # chunk ends mid-block
    assert_greedy_match(ours, checkpoint.tokens, checkpoint.margins)


def test_checkpoint_features_are_exercised(checkpoint: Reference) -> None:
    args = ModelArgs.from_dir(checkpoint.path)
    name = checkpoint.path.name
    if name.startswith("llama_tied"):
        assert args.tie_word_embeddings
    elif name.startswith("llama"):
        assert args.rope_scaling is not None
        assert (checkpoint.path / "model.safetensors.index.json").is_file()
        assert len(list(checkpoint.path.glob("*.safetensors"))) > 1
    elif name.startswith("qwen2"):
        assert args.attention_bias
        assert not args.o_proj_bias
        assert args.tie_word_embeddings
    else:
        assert args.qk_norm
        assert args.head_dim == 32


def test_mixed_batch_prefill_and_decode_match_alone(llama: Path) -> None:
    prompt_a, prompt_b = PROMPT, PROMPT[5:18]
    alone_a = PagedGreedy.single(load(llama)).generate(prompt_a, 6)
    alone_b = PagedGreedy.single(load(llama)).generate(prompt_b, 6)
    ref_b, margins_b = hf_greedy(llama, prompt_b, 6)
    assert_greedy_match(alone_b, ref_b, margins_b)

    driver = PagedGreedy.single(load(llama))
    a, b = Seq(tokens=list(prompt_a)), Seq(tokens=list(prompt_b))
    (first_b,) = driver.step([(b, len(prompt_b))])
    b.tokens.append(first_b)
    out_b = [first_b]
    # A prefills in chunks while B decodes in the same forward, then both decode together.
    for chunk in (9, 13, 15):
        token_a, token_b = driver.step([(a, chunk), (b, 1)])
        b.tokens.append(token_b)
        out_b.append(token_b)
    out_a = [token_a]
    a.tokens.append(token_a)
    for _ in range(2):
        token_a, token_b = driver.step([(b, 1), (a, 1)])[::-1]
        out_a.append(token_a)
        out_b.append(token_b)
        a.tokens.append(token_a)
        b.tokens.append(token_b)
    assert out_a == alone_a[: len(out_a)]
    assert out_b == alone_b[: len(out_b)]


def test_prefix_blocks_reused_by_second_sequence(llama: Path) -> None:
    tpb = 4
    driver = PagedGreedy.single(load(llama), tokens_per_block=tpb)
    first = Seq(tokens=list(PROMPT))
    driver.generate(PROMPT, 3, seq=first)
    shared = 24  # whole blocks of the first sequence's prompt
    prompt_b = [*PROMPT[:shared], 11, 12, 13, 14, 15]
    second = Seq(
        tokens=list(prompt_b), num_cached=shared, block_ids=first.block_ids[: shared // tpb]
    )
    blocks_before = driver.next_block
    reused = driver.generate(prompt_b, 8, seq=second)
    assert driver.next_block - blocks_before == len(second.block_ids) - shared // tpb
    fresh = PagedGreedy.single(load(llama), tokens_per_block=tpb).generate(prompt_b, 8)
    assert reused == fresh
    ref, margins = hf_greedy(llama, prompt_b, 8)
    assert_greedy_match(reused, ref, margins)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_runs(llama: Path, dtype: torch.dtype) -> None:
    model = load(llama, dtype)
    assert model.lm_head is not None
    assert model.lm_head.weight.dtype == dtype
    driver = PagedGreedy.single(model, layout=Layout.NHD)
    assert driver.stages[0][1].pool.dtype == dtype
    tokens = driver.generate(PROMPT, 4, chunks=(10,))
    assert len(tokens) == 4
    assert all(0 <= t < model.args.vocab_size for t in tokens)


def test_tiny_default_matches_hf(tmp_path: Path) -> None:
    path = ensure_tiny_checkpoint(tmp_path, TinySpec(num_layers=2))
    ours = PagedGreedy.single(load(path), tokens_per_block=8).generate(PROMPT, 12, chunks=(16,))
    ref, margins = hf_greedy(path, PROMPT, 12)
    assert_greedy_match(ours, ref, margins)


def test_tiny_sharded_tied_qwen3_matches_hf(tmp_path: Path) -> None:
    path = ensure_tiny_checkpoint(
        tmp_path,
        TinySpec(arch="qwen3", num_layers=2, tie_word_embeddings=True, head_dim=48, shards=3),
    )
    assert len(list(path.glob("*.safetensors"))) == 3
    ours = PagedGreedy.single(load(path), layout=Layout.NHD).generate(PROMPT, 10)
    ref, margins = hf_greedy(path, PROMPT, 10)
    assert_greedy_match(ours, ref, margins)


def test_cpu_prefill_attention_gives_sdpa_the_inputs_of_its_fused_kernel(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SDPA's fused CPU kernel takes 4-D inputs only: on [heads, q, D] it falls back to the math
    kernel, which materialises every score (a 2048-token prompt of `tiny` prefilled 6-7x slower:
    docs/BENCHMARKS.md). Both prefill cases go through it: a whole prompt (causal) and a chunk
    after computed keys (an explicit mask)."""
    shapes: list[tuple[int, ...]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        shapes.append(tuple(q.shape))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    tokens = PagedGreedy.single(load(llama)).generate(PROMPT, 2, chunks=(16,))
    assert len(tokens) == 2
    assert {len(shape) for shape in shapes} == {4}
    assert {shape[2] for shape in shapes} >= {16, len(PROMPT) - 16}  # both chunks' queries
