"""The paged attention kernel and the compile-free fused path on CUDA (run on the device machine).

* The kernel on mixed batches at real sizes (decode rows with long contexts, a 512-token chunk
  after a prefix, whole prompts up to 2k tokens, short tails, padding) against float64, for the
  8B geometry and other layouts / tokens_per_block / GQA groups, and for several tile configs.
* No compilation in steady state: after `CausalLM.warm_up` (which `DecodeGraphs.capture` runs),
  a staggered load through `ModelRunner` (mixed steps, eager and graph decode steps, prefills)
  compiles no Triton kernel variant.
* Greedy tokens of mixed steps on the Triton path equal each prompt generated alone on the
  per-sequence torch path (bf16 on the same GPU, near-tie rule).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.attention_reference import reference_attention
from tests.oracle import PagedGreedy, assert_greedy_match, make_cache, make_hf_checkpoint
from tests.runner_greedy import runner_greedy
from trtdisagg.config import KvCacheConfig, WorkerConfig
from trtdisagg.kv.cache import KVCache
from trtdisagg.kv.page_table import Layout
from trtdisagg.model.batch import AttentionMeta
from trtdisagg.model.loader import load_model
from trtdisagg.model.parallel import Parallel
from trtdisagg.worker.runner import ModelRunner, build_runner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")
pytest.importorskip("transformers")

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
BF16_NEAR_TIE = 0.25  # as in test_gpu_model.py: bf16 logits are quantised
# 8 layers, hidden 512, 8 heads of 64 over 2 kv heads (group 4)
BIG_LLAMA: dict[str, Any] = {
    "arch": "llama",
    "vocab_size": 2048,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_layers": 8,
    "num_heads": 8,
    "num_kv_heads": 2,
    "rope_llama3": True,
    "initializer_range": 0.05,
}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want64 = want.double()
    return float((got.double().cpu() - want64).norm() / want64.norm().clamp_min(1e-30))


def make_pool(layout: Layout, tpb: int, heads: int, dim: int, blocks: int) -> KVCache:
    cache = KVCache(
        num_blocks=blocks,
        num_layers=2,
        num_kv_heads=heads,
        head_dim=dim,
        tokens_per_block=tpb,
        layout=layout,
        dtype=BF16,
        device=CUDA,
    )
    cache.pool.normal_()
    return cache


def mixed_meta(
    cache: KVCache, q_lens: list[int], kv_lens: list[int], *, pad_seqs: int
) -> AttentionMeta:
    from trtdisagg.model import attention_meta

    tpb = cache.tokens_per_block
    counts = [math.ceil(n / tpb) for n in kv_lens]
    order = torch.randperm(cache.num_blocks)[: sum(counts)].tolist()
    tables = []
    for count in counts:
        tables.append(order[:count])
        order = order[count:]
    return attention_meta.from_lists(
        q_lens,
        kv_lens,
        tables,
        device=CUDA,
        num_seqs=len(q_lens) + pad_seqs,
        width=max(counts) + 3,
    )


# Decode rows (short and long contexts), a 512-token chunk after a 1,000-token prefix, whole
# prompts, short tails after a prefix-cache hit.
MIXED_Q = [1, 1, 1, 512, 2048, 3, 77, 1, 2]
MIXED_KV = [1, 900, 4100, 1512, 2048, 40, 77, 129, 300]


@pytest.mark.parametrize(
    ("layout", "tpb", "hq", "hkv", "d"),
    [
        (Layout.HND, 32, 32, 8, 128),  # the 8B geometry
        (Layout.NHD, 16, 16, 8, 128),  # group 2
        (Layout.HND, 64, 8, 8, 64),  # no GQA
        (Layout.NHD, 32, 8, 1, 64),  # group 8
    ],
)
def test_mixed_batch_matches_float64(layout: Layout, tpb: int, hq: int, hkv: int, d: int) -> None:
    from trtdisagg.model.paged_attention import SPLIT_CHOICES, AttentionTiles
    from trtdisagg.model.triton_ops import TritonOps

    torch.manual_seed(hq + tpb)
    cache = make_pool(layout, tpb, hkv, d, blocks=1024 * 32 // tpb)
    meta = mixed_meta(cache, MIXED_Q, MIXED_KV, pad_seqs=3)
    q = torch.randn(sum(MIXED_Q) + 17, hq, d, device=CUDA, dtype=BF16)  # 17 padding tokens
    want, owned = reference_attention(q, cache, 1, meta)
    tiles_variants = [AttentionTiles()]
    if hq == 32:  # other tile configs on the 8B geometry only (each compiles its own variants)
        tiles_variants += [
            AttentionTiles(long_rows=64, block_n=32, long_warps=4),
            AttentionTiles(long_rows=128, block_n=128, num_stages=2),
        ]
    cu_q = meta.cu_q.tolist()
    for tiles in tiles_variants:
        ops = TritonOps(tiles)
        for splits in (None, 1, SPLIT_CHOICES[-1]):
            got = ops.paged_attention(q, cache, 1, meta, num_splits=splits)
            assert torch.isfinite(got[owned.to(CUDA)]).all()
            err = rel_err(got[owned.to(CUDA)], want[owned])
            assert err < 1e-2, (tiles, splits, err)
            # Sequence by sequence too: a wrong sequence must not hide in the global norm.
            for s, q_len in enumerate(MIXED_Q):
                rows = slice(cu_q[s], cu_q[s] + q_len)
                assert rel_err(got[rows], want[rows]) < 1e-2, (tiles, splits, s)


def test_long_prefill_matches_float64() -> None:
    """An 8k-token prompt of the 8B geometry, in one launch, against float64 on the GPU (in
    chunks of queries: the whole score matrix would take 17 GB)."""
    from trtdisagg.model.triton_ops import TritonOps

    torch.manual_seed(8)
    n, hq, hkv, d = 8192, 32, 8, 128
    cache = make_pool(Layout.HND, 32, hkv, d, blocks=300)
    meta = mixed_meta(cache, [n], [n], pad_seqs=0)
    q = torch.randn(n, hq, d, device=CUDA, dtype=BF16)
    got = TritonOps().paged_attention(q, cache, 1, meta)
    blocks = meta.block_table[0, : n // 32].long()
    keys, values = (t.double().repeat_interleave(hq // hkv, 0) for t in cache.gather(1, blocks, n))
    for start in range(0, n, 1024):
        rows = slice(start, start + 1024)
        scores = q[rows].double().transpose(0, 1) @ keys.transpose(1, 2) / math.sqrt(d)
        hidden = (
            torch.arange(n, device=CUDA)[None, :]
            > torch.arange(start, start + 1024, device=CUDA)[:, None]
        )
        want = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ values
        assert rel_err(got[rows], want.transpose(0, 1).cpu()) < 1e-2, start


PROMPTS = [
    [(7 * i + 3) % 300 + 7 for i in range(37)],
    [(5 * i + 1) % 250 + 9 for i in range(9)],
    [(11 * i + 2) % 280 + 5 for i in range(700)],
    [(13 * i + 4) % 900 + 3 for i in range(150)],
    [(3 * i + 8) % 700 + 11 for i in range(2)],
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("big_llama"), **BIG_LLAMA)


def make_runner(path: Path, *, cuda_graphs: bool) -> ModelRunner:
    config = WorkerConfig(
        device="cuda",
        dtype="bfloat16",
        max_batch_size=8,
        cuda_graphs=cuda_graphs,
        kv_cache_config=KvCacheConfig(tokens_per_block=32, max_tokens=16384),
    )
    return build_runner(config, path, Parallel())


def test_no_compilation_after_warm_up(checkpoint: Path) -> None:
    """Prompts of 2..700 tokens join one per step next to the others' decodes, then decode
    together with shrinking batches: eager mixed steps, graph-replayed and eager decode steps.
    Nothing compiles after warm-up (capture warms up; the eager runner warms up by hand)."""
    from trtdisagg.model.triton_ops import compiled_variants

    graphed = make_runner(checkpoint, cuda_graphs=True)  # capture() ran model.warm_up
    assert graphed.graphs is not None
    eager = make_runner(checkpoint, cuda_graphs=False)
    eager.model.warm_up(eager.cache)
    torch.cuda.synchronize()
    warmed = compiled_variants()
    assert warmed["paged_attention"] >= 12, warmed
    runner_greedy(graphed, PROMPTS, NEW_TOKENS, stagger=True)
    runner_greedy(eager, PROMPTS, NEW_TOKENS, stagger=True)
    runner_greedy(eager, PROMPTS[:3], 3)  # prefill-only first step, then decode
    assert graphed.graphs.replays > 0
    torch.cuda.synchronize()
    assert compiled_variants() == warmed


def test_mixed_steps_greedy_match_per_sequence(checkpoint: Path) -> None:
    """Greedy tokens of staggered mixed steps on the Triton path (graphs on and off) equal each
    prompt generated alone on the per-sequence torch path, bf16 on this GPU."""
    references = []
    for prompt in PROMPTS:
        model = load_model(checkpoint, dtype=BF16, device=CUDA, parallel=Parallel())
        driver = PagedGreedy(stages=[(model, make_cache(model, Layout.HND, 32, 64))])
        margins: list[float] = []
        references.append((driver.generate(prompt, NEW_TOKENS, margins=margins), margins))
    compared = 0
    for cuda_graphs in (True, False):
        runner = make_runner(checkpoint, cuda_graphs=cuda_graphs)
        ours = runner_greedy(runner, PROMPTS, NEW_TOKENS, stagger=True)
        for mine, (ref_tokens, ref_margins) in zip(ours, references, strict=True):
            compared += assert_greedy_match(mine, ref_tokens, ref_margins, BF16_NEAR_TIE)
    assert compared >= 2 * NEW_TOKENS  # not everything stopped at a near-tie
