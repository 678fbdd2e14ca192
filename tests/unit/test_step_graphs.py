"""Mixed-step graph inputs (`step_graphs.StepStaging`) on CPU, under the Triton interpreter.

The graphs themselves are captured on the device (tests/gpu/test_gpu_step_graphs.py); here the
part that decides what they compute: a step padded to its token bucket, with its attention
metadata in the bucket's buffer, gives the logits of the same step run unpadded, through the
Triton ops; its late rows (tokens still in flight) are written into the padded batch; the buffer
holds exactly the layout the docstring gives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("a CUDA machine runs tests/gpu/test_gpu_step_graphs.py", allow_module_level=True)
triton = pytest.importorskip("triton")
pytest.importorskip("transformers")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not isinstance(triton.language.cdiv, InterpretedFunction):
    pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it)", allow_module_level=True)

from tests.oracle import make_cache, make_hf_checkpoint  # noqa: E402
from trtdisagg.kv.page_table import Layout  # noqa: E402
from trtdisagg.model import paged_attention, triton_ops  # noqa: E402
from trtdisagg.model.gemm_library import library_for  # noqa: E402
from trtdisagg.model.llama import CausalLM  # noqa: E402
from trtdisagg.model.loader import load_model  # noqa: E402
from trtdisagg.model.parallel import Parallel  # noqa: E402
from trtdisagg.worker.rank_plan import ItemInputs  # noqa: E402
from trtdisagg.worker.step_graphs import StepStaging, token_buckets  # noqa: E402
from trtdisagg.worker.step_inputs import build_batch, fill_late  # noqa: E402

CPU = torch.device("cpu")
TPB = 16


def test_token_buckets() -> None:
    buckets = token_buckets(2048)
    assert buckets[:5] == (16, 32, 64, 128, 192)
    assert 512 in buckets and 576 in buckets and 1024 in buckets and 1280 in buckets
    assert buckets[-1] == 2048 and list(buckets) == sorted(set(buckets))
    # Beyond 64 tokens a step is padded by at most a quarter of its size.
    for n in range(65, 2049):
        bucket = next(b for b in buckets if b >= n)
        assert bucket - n <= max(64, n // 4), n
    assert token_buckets(100) == (16, 32, 64, 112)
    assert token_buckets(0) == ()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    path: Path = make_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", num_layers=2)
    loaded = load_model(path, dtype=torch.float32, device=CPU, parallel=Parallel())
    tiles = paged_attention.AttentionTiles(long_rows=32, block_n=16)
    loaded.use_ops(triton_ops.TritonOps(tiles))
    return loaded


def items_of(prompts: list[list[int]], cached: list[int], tables: list[list[int]]):
    """One step: sequence i computes prompts[i][cached[i]:] in blocks tables[i]."""
    return [
        ItemInputs(
            request_id=i,
            token_ids=tuple(prompt[done:]),
            start=done,
            block_ids=tuple(table[: -(-len(prompt) // TPB)]),
            samples=True,
        )
        for i, (prompt, done, table) in enumerate(zip(prompts, cached, tables, strict=True))
    ]


# Padding rows carry activations nothing wrote (attention leaves rows past cu_q[S] as they were
# allocated): numpy, under Triton's interpreter, warns when the norm squares or sums that
# garbage. The step's own rows are what the test compares.
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered in reduce:RuntimeWarning")
def test_a_padded_mixed_step_gives_the_unpadded_logits(model: CausalLM) -> None:
    torch.manual_seed(0)
    cache = make_cache(model, Layout.HND, TPB, 32)
    first = [[(5 * i + k) % 300 + 7 for i in range(n)] for k, n in enumerate((20, 35))]
    tables = [[3, 9], [12, 4, 30], [7, 21]]
    # Step 1 prefills two prompts; step 2 decodes both next to a third prompt's prefill.
    eager_1 = build_batch(items_of(first, [0, 0], tables[:2]), CPU, tokens_per_block=TPB,
                          batched_decode=False)  # fmt: skip
    with torch.inference_mode():
        model(eager_1, cache)
    snapshot = cache.pool.clone()
    grown = [first[0] + [41], first[1] + [42], [(3 * i + 2) % 280 + 5 for i in range(23)]]
    items = items_of(grown, [20, 35, 0], tables)
    with torch.inference_mode():
        want = model(build_batch(items, CPU, tokens_per_block=TPB, batched_decode=False), cache)
        written = cache.pool.clone()
        cache.pool.copy_(snapshot)
        staging = StepStaging.allocate(32, 8, 4, tokens_per_block=TPB, device=CPU)
        batch = staging.fill(items)
        last = model(batch, cache, logits=False)
        got = model.head(last[: len(items)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Padding tokens write no KV: the pool holds exactly what the unpadded step wrote.
    assert torch.equal(cache.pool, written)


def test_late_rows_are_written_into_the_padded_batch(model: CausalLM) -> None:
    staging = StepStaging.allocate(16, 4, 2, tokens_per_block=TPB, device=CPU)
    items = items_of([[5, 6, 7, 0], [8, 9]], [3, 0], [[1], [2]])
    batch = staging.fill(items)
    sampled = torch.tensor([77, 55], dtype=torch.long)
    fill_late(batch.input_ids, torch.tensor([0]), sampled, torch.tensor([1]))
    assert batch.input_ids[:3].tolist() == [55, 8, 9]


def test_staging_layout_and_limits() -> None:
    staging = StepStaging.allocate(16, 4, 3, tokens_per_block=4, device=CPU)
    items = [
        ItemInputs(request_id=1, token_ids=(9,), start=5, block_ids=(7, 2), samples=True),
        ItemInputs(request_id=2, token_ids=(1, 2, 3), start=0, block_ids=(5,), samples=True),
    ]
    batch = staging.fill(items)
    assert batch.input_ids.tolist() == [9, 1, 2, 3] + [0] * 12
    assert batch.positions.tolist()[:4] == [5, 0, 1, 2]
    assert batch.slot_mapping.tolist() == [2 * 4 + 1, 20, 21, 22] + [-1] * 12
    assert batch.logits_indices.tolist() == [0, 3, 0, 0]
    meta = batch.attention
    assert meta is not None and meta.max_q_len == 16
    assert meta.cu_q.tolist() == [0, 1, 4, 4, 4]  # padding sequences: q_len 0
    assert meta.kv_lens.tolist() == [6, 3, 0, 0]
    assert meta.block_table[:2].tolist() == [[7, 2, 0], [5, 0, 0]]
    assert staging.fits(items)
    too_wide = [
        ItemInputs(request_id=3, token_ids=(1,), start=15, block_ids=(1, 2, 3, 4), samples=True)
    ]
    assert not staging.fits(too_wide)
    assert not staging.fits([items[1]] * 5)  # more sequences than the bucket holds
    with pytest.raises(ValueError, match="do not fit"):
        staging.fill([items[1]] * 6)  # 18 tokens
    again = staging.fill(items[1:])  # a refill clears what the last step left
    assert again.input_ids.tolist()[:4] == [1, 2, 3, 0]
    assert again.attention is not None and again.attention.kv_lens.tolist() == [3, 0, 0, 0]


def test_captures_of_32_to_160_rows_prefer_cublaslt_and_others_cublas() -> None:
    assert [library_for(rows) for rows in (1, 16, 31)] == ["cublas"] * 3
    assert [library_for(rows) for rows in (32, 64, 96, 160)] == ["cublaslt"] * 4
    assert [library_for(rows) for rows in (161, 256, 2048)] == ["cublas"] * 3
