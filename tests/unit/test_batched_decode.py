"""The batched-decode and fused paths on CPU agree with the per-sequence reference path.

The GPU paths (Triton kernels, CUDA graphs) are checked in tests/gpu; here the same code runs
through `TorchOps` on CPU in float32, so any indexing or masking mistake in the batched gather,
the fused weights or the runner's decode staging shows up as a token or logit difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.oracle import (
    PagedGreedy,
    Seq,
    assert_greedy_match,
    hf_greedy,
    make_cache,
    make_hf_checkpoint,
)
from tests.runner_greedy import runner_greedy
from trtdisagg.kv.cache import KVCache
from trtdisagg.kv.page_table import Layout
from trtdisagg.model.batch import DecodeMeta, ForwardBatch
from trtdisagg.model.llama import CausalLM
from trtdisagg.model.loader import load_model
from trtdisagg.model.ops import TorchOps, decode_attention_torch
from trtdisagg.model.parallel import Parallel
from trtdisagg.worker.decode_graphs import (
    DecodeRows,
    DecodeStaging,
    blocks_for,
    decode_rows,
    graph_batch_sizes,
)
from trtdisagg.worker.rank_plan import ItemInputs
from trtdisagg.worker.runner import ModelRunner

pytest.importorskip("transformers")

PROMPTS = [
    [(7 * i + 3) % 300 + 7 for i in range(37)],
    [(5 * i + 1) % 250 + 9 for i in range(9)],
    [(11 * i + 2) % 280 + 5 for i in range(22)],
]
NEW_TOKENS = 8

CHECKPOINTS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama", "num_layers": 3, "rope_llama3": True},  # GQA group 2
    "llama_mqa": {"arch": "llama", "num_kv_heads": 1, "tie_word_embeddings": True},
    "qwen2": {"arch": "qwen2"},  # q/k/v biases
    "qwen3": {"arch": "qwen3", "head_dim": 32},  # q/k norms
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp(request.param), **CHECKPOINTS[request.param])


def load(path: Path, *, fused: bool = False) -> CausalLM:
    model = load_model(path, dtype=torch.float32, device=torch.device("cpu"), parallel=Parallel())
    if fused:
        model.use_ops(TorchOps())
    return model


def generate_together(driver: PagedGreedy) -> tuple[list[list[int]], list[list[float]]]:
    """Prefill each prompt alone, then decode all three in one batch per step."""
    seqs = [Seq(tokens=list(p)) for p in PROMPTS]
    outs: list[list[int]] = [[] for _ in seqs]
    margins: list[list[float]] = [[] for _ in seqs]
    for i, seq in enumerate(seqs):
        (token,) = driver.step([(seq, len(seq.tokens))])
        outs[i].append(token)
        margins[i].append(driver.last_margins[0])
        seq.tokens.append(token)
    for _ in range(NEW_TOKENS - 1):
        tokens = driver.step([(seq, 1) for seq in seqs])
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            outs[i].append(token)
            margins[i].append(driver.last_margins[i])
            seq.tokens.append(token)
    return outs, margins


@pytest.mark.parametrize(("layout", "tokens_per_block"), [(Layout.HND, 4), (Layout.NHD, 6)])
def test_batched_and_fused_decode_match_per_sequence(
    checkpoint: Path, layout: Layout, tokens_per_block: int
) -> None:
    def run(*, batched: bool, fused: bool) -> tuple[list[list[int]], list[list[float]]]:
        driver = PagedGreedy.single(
            load(checkpoint, fused=fused),
            layout=layout,
            tokens_per_block=tokens_per_block,
            batched_decode=batched,
        )
        return generate_together(driver)

    ref, ref_margins = run(batched=False, fused=False)
    for batched, fused in [(True, False), (False, True), (True, True)]:
        ours, _ = run(batched=batched, fused=fused)
        for mine, want, margins in zip(ours, ref, ref_margins, strict=True):
            assert_greedy_match(mine, want, margins)
    # And the reference itself is transformers' answer.
    hf_tokens, hf_margins = hf_greedy(checkpoint, PROMPTS[1], NEW_TOKENS)
    assert_greedy_match(ref[1], hf_tokens, hf_margins)


def test_decode_attention_equals_per_sequence_sdpa() -> None:
    """The padded gather + one SDPA equals attending each sequence alone, logits-level."""
    torch.manual_seed(0)
    for layout in (Layout.HND, Layout.NHD):
        cache = KVCache(
            num_blocks=40,
            num_layers=2,
            num_kv_heads=2,
            head_dim=16,
            tokens_per_block=5,
            layout=layout,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
        cache.pool.normal_()
        lens = [1, 5, 6, 23]
        tables = [[3], [7], [9, 1], [30, 2, 11, 20, 0]]
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        meta = DecodeMeta(
            block_table=torch.tensor(padded),
            context_lens=torch.tensor(lens),
            max_context_len=max(lens),
        )
        q = torch.randn(len(lens), 6, 16)
        out = decode_attention_torch(q, cache, 1, meta)
        for i, (length, table) in enumerate(zip(lens, tables, strict=True)):
            keys, values = cache.gather(1, torch.tensor(table), length)
            keys = keys.repeat_interleave(3, dim=0)
            values = values.repeat_interleave(3, dim=0)
            want = torch.nn.functional.scaled_dot_product_attention(q[i][:, None, :], keys, values)[
                :, 0
            ]
            torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-6)


def test_fused_weights_are_views_and_reference_path_still_works(tmp_path: Path) -> None:
    path = make_hf_checkpoint(tmp_path / "ckpt", "llama", num_layers=2)
    model = load(path)
    before = PagedGreedy.single(model).generate(PROMPTS[0], 5)
    model.use_ops(TorchOps())
    attn = model.decoder_layers[0].self_attn
    assert attn.qkv_weight is not None
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    fused = PagedGreedy.single(model).generate(PROMPTS[0], 5)
    model.use_ops(None)
    after = PagedGreedy.single(model).generate(PROMPTS[0], 5)
    assert before == after == fused


@pytest.mark.parametrize("mode", ["batched", "fused"])
def test_runner_decode_path_on_cpu(tmp_path: Path, mode: str) -> None:
    """ModelRunner with batched decode (DecodeStaging, decode_rows) gives the tokens of the
    per-sequence runner, with several sequences in every step."""
    path = make_hf_checkpoint(tmp_path / "ckpt", "llama", num_layers=2)

    def runner(batched: bool) -> ModelRunner:
        model = load(path, fused=mode == "fused" and batched)
        cache = make_cache(model, Layout.HND, 4, 64)
        return ModelRunner(
            model=model,
            cache=cache,
            device=cache.device,
            tokens_per_block=4,
            batched_decode=batched,
        )

    ref = runner_greedy(runner(False), PROMPTS, NEW_TOKENS)
    ours = runner_greedy(runner(True), PROMPTS, NEW_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        margins: list[float] = []
        alone = PagedGreedy.single(load(path)).generate(prompt, NEW_TOKENS, margins=margins)
        assert_greedy_match(ref[i], alone, margins)
        assert_greedy_match(ours[i], alone, margins)


@pytest.mark.parametrize("fused", [False, True])
def test_mixed_steps_attend_their_decode_rows_batched(
    tmp_path: Path, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts joining one per step: each step prefills one prompt next to the others' decodes.
    The leading decode rows go through the batched kernel (`decode_head`) and the tokens equal
    the per-sequence runner's and each prompt generated alone."""
    path = make_hf_checkpoint(tmp_path / "ckpt", "llama", num_layers=2)
    prompts = [*PROMPTS, [(3 * i + 5) % 200 + 11 for i in range(15)]]

    def runner(batched: bool) -> ModelRunner:
        model = load(path, fused=fused and batched)
        cache = make_cache(model, Layout.NHD, 4, 64)
        return ModelRunner(
            model=model, cache=cache, device=cache.device, tokens_per_block=4,
            batched_decode=batched,
        )  # fmt: skip

    heads: list[int] = []
    build = ModelRunner._build_batch

    def recording(self: ModelRunner, items: Sequence[ItemInputs]) -> ForwardBatch:
        batch = build(self, items)
        if batch.decode_head is not None:
            heads.append(batch.decode_head.block_table.shape[0])
        return batch

    monkeypatch.setattr(ModelRunner, "_build_batch", recording)
    ours = runner_greedy(runner(True), prompts, NEW_TOKENS, stagger=True)
    assert heads == [2, 3], "steps 2 and 3 prefill a prompt after 2 and 3 decodes"
    ref = runner_greedy(runner(False), prompts, NEW_TOKENS, stagger=True)
    assert heads == [2, 3], "the per-sequence runner has no decode head"
    for i, prompt in enumerate(prompts):
        margins: list[float] = []
        alone = PagedGreedy.single(load(path)).generate(prompt, NEW_TOKENS, margins=margins)
        assert_greedy_match(ref[i], alone, margins)
        assert_greedy_match(ours[i], alone, margins)


def test_decode_rows_and_staging_layout() -> None:
    rows = decode_rows(
        [([5, 6, 7], [], 2, [4, 5, 1]), ([1, 2], [3, 8, 9], 4, [6, 2, 9])],
        tokens_per_block=2,
    )
    assert rows.token_ids == [7, 9]
    assert rows.positions == [2, 4]
    assert rows.context_lens == [3, 5]
    assert rows.block_tables == [[4, 5], [6, 2, 9]]  # only the blocks in use
    assert rows.slots == [5 * 2 + 0, 9 * 2 + 0]
    with pytest.raises(ValueError, match="cannot hold"):
        decode_rows([([1, 2, 3], [], 2, [4])], tokens_per_block=2)

    staging = DecodeStaging.allocate(4, 3, tokens_per_block=2, device=torch.device("cpu"))
    batch = staging.fill(rows)
    assert batch.input_ids.tolist() == [7, 9, 0, 0]
    assert batch.slot_mapping.tolist() == [10, 18, -1, -1]
    assert batch.decode is not None
    assert batch.decode.context_lens.tolist() == [3, 5, 0, 0]
    assert batch.decode.block_table[:2].tolist() == [[4, 5, 0], [6, 2, 9]]
    exact = DecodeStaging.allocate(2, 3, tokens_per_block=2, device=torch.device("cpu"))
    meta = exact.fill(rows).decode
    assert meta is not None and meta.max_context_len == 5
    with pytest.raises(ValueError, match="exceed"):
        DecodeStaging.allocate(1, 3, tokens_per_block=2, device=torch.device("cpu")).fill(rows)
    empty = DecodeRows(token_ids=[], positions=[], slots=[], context_lens=[], block_tables=[])
    assert staging.fill(empty).slot_mapping.tolist() == [-1] * 4


def test_graph_batch_sizes_and_widths() -> None:
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_batch_sizes(5) == (1, 2, 4, 8)
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(256) == (1, 2, 4, 8, 16, 32, 64)
    assert blocks_for(4096, 32, 10_000) == 128
    assert blocks_for(4096, 32, 50) == 50
    assert blocks_for(33, 32, 10) == 2
