"""The paged attention kernel and the Triton fused path, on CPU under the Triton interpreter.

* The kernel against a float64 reference (`tests.attention_reference`) on batches that mix
  decode rows, prefill chunks, prefix-cache tails and short tails, with padding sequences and
  padding tokens, both KV layouts, tokens_per_block 16/32/64, GQA groups 1, 2 and 8, several key
  splits; a decode step's padding rows (context length 0) come out 0.
* A model on `TritonOps` gives the torch path's logits and greedy tokens through mixed steps.
* Specialisation: every launch that a mixed sequence of steps makes through `ModelRunner` has a
  Triton specialisation key that `CausalLM.warm_up` already produced, so nothing compiles while
  serving. The keys come from Triton's own binder (`create_function_from_signature`), which runs
  without a GPU.

`tests/conftest.py` switches the interpreter on where no CUDA device is present (on a GPU
machine the same checks run compiled, in tests/gpu/test_gpu_paged_attention.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip(
        "a CUDA machine runs tests/gpu/test_gpu_paged_attention.py", allow_module_level=True
    )
triton = pytest.importorskip("triton")
pytest.importorskip("transformers")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not isinstance(triton.language.cdiv, InterpretedFunction):
    pytest.skip(
        "needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)",
        allow_module_level=True,
    )

from tests.attention_reference import reference_attention  # noqa: E402
from tests.oracle import PagedGreedy, Seq, make_cache, make_hf_checkpoint  # noqa: E402
from tests.runner_greedy import runner_greedy  # noqa: E402
from trtdisagg.kv.cache import KVCache  # noqa: E402
from trtdisagg.kv.page_table import Layout  # noqa: E402
from trtdisagg.model import attention_meta, paged_attention, triton_ops  # noqa: E402
from trtdisagg.model.batch import AttentionMeta, DecodeMeta  # noqa: E402
from trtdisagg.model.llama import CausalLM  # noqa: E402
from trtdisagg.model.loader import load_model  # noqa: E402
from trtdisagg.model.ops import TorchOps  # noqa: E402
from trtdisagg.model.parallel import Parallel  # noqa: E402
from trtdisagg.worker.runner import ModelRunner  # noqa: E402

CPU = torch.device("cpu")
SMALL_TILES = paged_attention.AttentionTiles(long_rows=32, block_n=16)


def make_pool(
    layout: Layout, tpb: int, heads: int, dim: int, *, dtype: torch.dtype = torch.float32
) -> KVCache:
    cache = KVCache(
        num_blocks=48,
        num_layers=2,
        num_kv_heads=heads,
        head_dim=dim,
        tokens_per_block=tpb,
        layout=layout,
        dtype=dtype,
        device=CPU,
    )
    cache.pool.copy_(torch.randn(cache.pool.shape))
    return cache


def scattered_tables(kv_lens: list[int], tpb: int, num_blocks: int) -> list[list[int]]:
    """Each sequence's blocks, drawn without repetition in a shuffled order."""
    order = torch.randperm(num_blocks).tolist()
    tables = []
    for kv_len in kv_lens:
        count = -(-kv_len // tpb)
        tables.append(order[:count])
        order = order[count:]
    return tables


def check(
    q: torch.Tensor,
    cache: KVCache,
    meta: AttentionMeta,
    *,
    splits: int | None,
    tol: float,
    tiles: paged_attention.AttentionTiles = SMALL_TILES,
) -> torch.Tensor:
    got = triton_ops.TritonOps(tiles).paged_attention(q, cache, 1, meta, num_splits=splits)
    want, owned = reference_attention(q, cache, 1, meta)
    rows = got[owned].double()
    assert torch.isfinite(rows).all()
    err = float((rows - want[owned]).norm() / want[owned].norm())
    assert err < tol, (err, splits)
    return got


# (q_len, kv_len): decode rows (one in its first block, one across blocks), a whole prompt, a
# prefix-cache tail longer than a short tile, and short tails that fit one.
MIXED = [(1, 1), (1, 70), (45, 45), (3, 52), (21, 90), (2, 17), (1, 33)]


@pytest.mark.parametrize(
    ("layout", "tpb", "hq", "hkv", "dim"),
    [
        (Layout.HND, 16, 4, 2, 16),  # GQA group 2
        (Layout.NHD, 32, 2, 2, 32),  # no GQA: a short tile holds 16 tokens
        (Layout.HND, 64, 8, 1, 16),  # group 8: a short tile holds 2 tokens
    ],
)
def test_mixed_batch_matches_reference(
    layout: Layout, tpb: int, hq: int, hkv: int, dim: int
) -> None:
    torch.manual_seed(hq * 7 + tpb)
    cache = make_pool(layout, tpb, hkv, dim)
    q_lens = [q for q, _ in MIXED]
    kv_lens = [kv for _, kv in MIXED]
    tables = scattered_tables(kv_lens, tpb, cache.num_blocks)
    # Padded as a size bucket would be: two empty sequences, a wider table, 5 padding tokens.
    meta = attention_meta.from_lists(
        q_lens, kv_lens, tables, device=CPU, num_seqs=len(MIXED) + 2, width=8
    )
    q = torch.randn(sum(q_lens) + 5, hq, dim)
    for splits in (1, 4):
        check(q, cache, meta, splits=splits, tol=1e-5)


def test_prefill_only_and_the_default_split() -> None:
    torch.manual_seed(3)
    cache = make_pool(Layout.NHD, 16, 2, 16)
    q_lens = kv_lens = [40, 7, 64]
    meta = attention_meta.from_lists(
        q_lens, kv_lens, scattered_tables(kv_lens, 16, cache.num_blocks), device=CPU
    )
    assert meta.max_q_len == 64
    check(torch.randn(sum(q_lens), 4, 16), cache, meta, splits=None, tol=1e-5)


def test_splits_take_at_least_their_minimum_of_keys_and_empty_ones_are_left_out() -> None:
    """With more splits launched than a context fills (`MIN_SPLIT_KEYS` keys each), the splits
    past its end neither attend nor wait to be merged: a context just over one split's
    minimum, one just under, and one over two splits all match the reference. Each launch
    leaves its arrival counters at zero, so the same launch again gives the same rows."""
    torch.manual_seed(5)
    cache = make_pool(Layout.HND, 16, 2, 16)
    least = paged_attention.MIN_SPLIT_KEYS.value
    lens = [2 * least + 44, least + 1, least, 1]
    meta = attention_meta.from_lists(
        [1] * len(lens), lens, scattered_tables(lens, 16, cache.num_blocks), device=CPU
    )
    q = torch.randn(len(lens), 4, 16)
    for splits in (2, 4, 32):
        first = check(q, cache, meta, splits=splits, tol=1e-5)
        assert not paged_attention._arrival_buffers[CPU][-1].any()
        assert torch.equal(check(q, cache, meta, splits=splits, tol=1e-5), first)


def test_outgrown_arrival_counters_stay_allocated_for_graphs_captured_on_them() -> None:
    """A launch with more (sequence, kv head) pairs than the counters hold gets a larger zeroed
    buffer; the one it outgrew stays referenced, since a CUDA graph may still launch on it."""
    device = torch.device("cpu", 7)  # a key of its own: other tests' buffers stay out of it
    first = paged_attention._arrival_counters(device, 1)
    assert paged_attention._arrival_counters(device, first.numel()) is first
    larger = paged_attention._arrival_counters(device, first.numel() + 1)
    assert larger.numel() > first.numel() and not larger.any()
    kept = paged_attention._arrival_buffers[device]
    assert len(kept) == 2 and kept[0] is first and kept[1] is larger
    assert paged_attention._arrival_counters(device, 1) is larger
    del paged_attention._arrival_buffers[device]


def test_decode_step_with_padding_rows() -> None:
    """A decode step as the graph staging sends it: rows with context length 0 are padding,
    attend to nothing and come out 0; the others match the reference."""
    torch.manual_seed(4)
    cache = make_pool(Layout.HND, 32, 2, 16)
    lens = [5, 100, 0, 33, 0]
    tables = [t + [0] * (4 - len(t)) for t in scattered_tables(lens, 32, cache.num_blocks)]
    decode = DecodeMeta(
        block_table=torch.tensor(tables, dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        max_context_len=max(lens),
    )
    meta = attention_meta.from_decode(decode)
    q = torch.randn(len(lens), 4, 16)
    for splits in (1, 8):
        got = check(q, cache, meta, splits=splits, tol=1e-5)
        assert float(got[[2, 4]].abs().max()) == 0.0
    # The torch path's batched decode agrees on the real rows.
    real = [0, 1, 3]
    decode_real = DecodeMeta(
        block_table=decode.block_table[real], context_lens=decode.context_lens[real],
        max_context_len=100,
    )  # fmt: skip
    torch.testing.assert_close(
        TorchOps().decode_attention(q[real], cache, 1, decode_real), got[real], rtol=1e-5, atol=1e-5
    )


def test_bf16_inputs_within_bf16_tolerance() -> None:
    torch.manual_seed(5)
    cache = make_pool(Layout.HND, 16, 2, 32, dtype=torch.bfloat16)
    q_lens, kv_lens = [1, 30, 2], [50, 30, 40]
    meta = attention_meta.from_lists(
        q_lens, kv_lens, scattered_tables(kv_lens, 16, cache.num_blocks), device=CPU
    )
    check(torch.randn(33, 4, 32).to(torch.bfloat16), cache, meta, splits=2, tol=1e-2)


def test_meta_builders_agree_and_refuse_bad_input() -> None:
    blocks = [torch.tensor([4, 9]), torch.tensor([7]), torch.tensor([1, 2, 3])]
    from trtdisagg.model.batch import SeqSlice

    seqs = [
        SeqSlice(q_start=0, q_len=1, kv_len=6, block_ids=blocks[0]),
        SeqSlice(q_start=1, q_len=3, kv_len=3, block_ids=blocks[1]),
        SeqSlice(q_start=4, q_len=2, kv_len=9, block_ids=blocks[2]),
    ]
    meta = attention_meta.from_seqs(seqs, CPU)
    assert meta.cu_q.tolist() == [0, 1, 4, 6]
    assert meta.kv_lens.tolist() == [6, 3, 9]
    assert meta.block_table.tolist() == [[4, 9, 9], [7, 7, 7], [1, 2, 3]]
    assert meta.max_q_len == 3
    assert meta.live.tolist() == [3]
    listed = attention_meta.from_lists(
        [1, 3, 2], [6, 3, 9], [[4, 9], [7], [1, 2, 3]], device=CPU, num_seqs=4, width=5
    )
    assert listed.cu_q.tolist() == [0, 1, 4, 6, 6]
    assert listed.kv_lens.tolist() == [6, 3, 9, 0]
    assert listed.live.tolist() == [3]  # the fourth sequence is padding
    assert listed.block_table[:3, :3].tolist() == [[4, 9, 0], [7, 0, 0], [1, 2, 3]]
    with pytest.raises(ValueError, match="packed in order"):
        attention_meta.from_seqs([seqs[1], seqs[0]], CPU)
    with pytest.raises(ValueError, match="do not fit"):
        attention_meta.from_lists([1], [9], [[1, 2, 3]], device=CPU, width=2)
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        attention_meta.from_lists([4], [3], [[1]], device=CPU)
    with pytest.raises(ValueError, match="int32"):
        AttentionMeta(
            cu_q=torch.tensor([0, 1]), kv_lens=torch.tensor([1], dtype=torch.int32),
            block_table=torch.zeros(1, 1, dtype=torch.int32),
            live=torch.ones(1, dtype=torch.int32), max_q_len=1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="shape"):
        AttentionMeta(
            cu_q=listed.cu_q, kv_lens=listed.kv_lens, block_table=listed.block_table,
            live=listed.cu_q, max_q_len=1,
        )  # fmt: skip


# ---- the model on the Triton ops ----


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", num_layers=2)


def load(path: Path, ops: TorchOps | None) -> CausalLM:
    model = load_model(path, dtype=torch.float32, device=CPU, parallel=Parallel())
    model.use_ops(ops)
    return model


def test_mixed_step_logits_match_the_torch_path(checkpoint: Path) -> None:
    """Two prompts decode while a third prefills in chunks, next to each other in one step."""

    def run(ops: TorchOps | None) -> list[torch.Tensor]:
        driver = PagedGreedy.single(load(checkpoint, ops), tokens_per_block=16, num_blocks=16)
        a, b = Seq(tokens=list(range(5, 25))), Seq(tokens=list(range(50, 55)))
        c = Seq(tokens=[(3 * i + 1) % 300 + 7 for i in range(24)])
        driver.step([(a, 20), (b, 5)])
        logits = []
        for work in ([(a, 1), (b, 1), (c, 17)], [(a, 1), (b, 1), (c, 7)], [(a, 1), (c, 1)]):
            for seq, _ in work:
                if seq.num_cached == len(seq.tokens):
                    seq.tokens.append(7)
            driver.step(work)
            assert driver.last_logits is not None
            logits.append(driver.last_logits)
        return logits

    for want, got in zip(run(None), run(triton_ops.TritonOps(SMALL_TILES)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---- specialisation keys: warm-up covers serving ----


class Recorder:
    """Stands in for a Triton kernel: records each launch's arguments, runs nothing."""

    def __init__(self, name: str, kernel: Any, launches: list[tuple[str, tuple[Any, ...]]]):
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        # The interpreter's stand-in keeps the jit options; a JITFunction of the same function
        # is what a GPU process has, and its binder computes the specialisation key.
        jit = JITFunction(kernel.fn, **kernel.kwargs)
        self.binder: Callable[..., Any] = create_function_from_signature(
            jit.signature, jit.params, BaseBackend
        )
        self.name = name
        self.launches = launches

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            _, specialization, options = self.binder(*args, **kwargs)
            key = (repr(specialization), tuple(sorted(options.items())))
            self.launches.append((self.name, key))

        return launch


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[Any, ...]]]:
    recorded: list[tuple[str, tuple[Any, ...]]] = []
    for module, names in (
        (triton_ops, ("_rms_norm_kernel", "_silu_mul_kernel", "_rope_kv_kernel")),
        (paged_attention, ("_paged_attention_kernel",)),
    ):
        for name in names:
            monkeypatch.setattr(module, name, Recorder(name, getattr(module, name), recorded))
    return recorded


def test_serving_meets_only_warmed_up_variants(
    checkpoint: Path, launches: list[tuple[str, tuple[Any, ...]]]
) -> None:
    """Prompts of several lengths join one per step (mixed steps with a varying number of
    sequences, table widths and offsets into the runner's packed inputs), then decode-only
    steps of shrinking batches through the staging buffers."""
    model = load(checkpoint, triton_ops.TritonOps(SMALL_TILES))
    cache = make_cache(model, Layout.NHD, 16, 64)
    model.warm_up(cache)
    warmed = set(launches)
    by_kernel: dict[str, int] = {}
    for name, _ in warmed:
        by_kernel[name] = by_kernel.get(name, 0) + 1
    # norm with/without residual; rope for int32/int64 slots; attention decode-only or not,
    # times each split count.
    splits = len(paged_attention.SPLIT_CHOICES)
    assert by_kernel == {
        "_rms_norm_kernel": 2,
        "_silu_mul_kernel": 1,
        "_rope_kv_kernel": 2,
        "_paged_attention_kernel": 2 * splits,
    }
    launches.clear()
    runner = ModelRunner(
        model=model, cache=cache, device=CPU, tokens_per_block=16, batched_decode=True
    )
    prompts = [[(5 * i + k) % 300 + 7 for i in range(n)] for k, n in enumerate((1, 37, 5, 80, 16))]
    runner_greedy(runner, prompts, 3, stagger=True)
    served = set(launches)
    assert {name for name, _ in served} == set(by_kernel)
    assert served <= warmed, served - warmed
