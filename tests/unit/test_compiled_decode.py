"""The CPU's compiled decode step (`cpu_compile`) gives the eager step's tokens, without compiling
anything once warmed up.

The prompts decode one at a time and three together, with contexts that cross block
boundaries, so both compiled graphs (one sequence; several) run over many table widths; the
blocks are handed out shuffled. The eager runner's tokens are checked against the model alone
under the near-tie rule (`assert_greedy_match`), and the compiled runner's against the same.
A late row's token (asynchronous steps) reaches the compiled step's inputs as the eager one's.

Compiling costs tens of seconds on a cold cache, so one case compiles (the default layout, in
bf16, where inductor must round as eager does); `TracedOps`' indexing of both pool layouts is
checked with the same step run eagerly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch

from tests.oracle import (
    NEAR_TIE,
    PagedGreedy,
    assert_greedy_match,
    make_cache,
    make_hf_checkpoint,
)
from tests.runner_greedy import runner_greedy
from trtdisagg.kv.page_table import Layout
from trtdisagg.model.batch import ForwardBatch
from trtdisagg.model.llama import CausalLM
from trtdisagg.model.loader import load_model
from trtdisagg.model.ops import TorchOps
from trtdisagg.model.parallel import Parallel
from trtdisagg.worker.compiled_decode import CompiledDecode
from trtdisagg.worker.decode_graphs import decode_rows
from trtdisagg.worker.runner import ModelRunner
from trtdisagg.worker.step_inputs import fill_late

PROMPTS = [
    [(7 * i + 3) % 300 + 7 for i in range(13)],
    [(5 * i + 1) % 250 + 9 for i in range(3)],
    [(11 * i + 2) % 280 + 5 for i in range(22)],
]
NEW_TOKENS = 12
# bf16 logits are coarse: a margin under this may flip with the order of a sum (the GPU tests'
# bf16 tolerance).
BF16_NEAR_TIE = 0.25


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Each compiled runner holds its own graphs: forget them afterwards, so that tests in this
    process never reach dynamo's limit of graphs per function."""
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(("layout", "tokens_per_block"), [(Layout.HND, 4), (Layout.NHD, 3)])
def test_traced_ops_run_eagerly_give_the_eager_tokens(
    tmp_path: Path, layout: Layout, tokens_per_block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`TracedOps`' arithmetic and pool indexing in both layouts, without compiling (fast)."""
    monkeypatch.setattr(torch, "compile", lambda forward, **_: forward)
    check_decode(tmp_path, layout, tokens_per_block, torch.float32, monkeypatch, compiled=False)


@pytest.mark.slow  # two graphs to compile: tens of seconds on a cold inductor cache
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_decode_gives_the_eager_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled, in the default layout, in bf16: inductor must round as eager does."""
    check_decode(tmp_path, Layout.HND, 4, torch.bfloat16, monkeypatch, compiled=True)


def unique_graphs() -> int:
    """Graphs dynamo has compiled in this process (imported here: importing dynamo is heavy, and
    only the compiling test needs it)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def check_decode(
    tmp_path: Path,
    layout: Layout,
    tokens_per_block: int,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
    *,
    compiled: bool,
) -> None:
    path = make_hf_checkpoint(tmp_path / "ckpt", "qwen3", num_layers=1, head_dim=32)

    def load() -> CausalLM:
        return load_model(path, dtype=dtype, device=torch.device("cpu"), parallel=Parallel())

    def runner() -> ModelRunner:
        model = load()
        model.use_ops(TorchOps())
        cache = make_cache(model, layout, tokens_per_block, 64)
        return ModelRunner(
            model=model,
            cache=cache,
            device=cache.device,
            tokens_per_block=tokens_per_block,
            batched_decode=True,
        )

    fast = runner()
    fast.compiled = CompiledDecode(fast.model, fast.cache)
    fast.compiled.warm_up()
    assert not fast.cache.pool.any(), "warm-up leaves the pool as it found it"
    graphs = unique_graphs() if compiled else 0

    sizes: list[int] = []
    call = CompiledDecode.__call__

    def counting(self: CompiledDecode, batch: ForwardBatch) -> torch.Tensor:
        sizes.append(batch.num_tokens)
        return call(self, batch)

    monkeypatch.setattr(CompiledDecode, "__call__", counting)
    together = runner_greedy(fast, PROMPTS, NEW_TOKENS)
    alone = [runner_greedy(fast, [prompt], NEW_TOKENS)[0] for prompt in PROMPTS]
    assert sizes == [3] * (NEW_TOKENS - 1) + [1] * (NEW_TOKENS - 1) * len(PROMPTS)
    if compiled:
        assert unique_graphs() == graphs, "a step compiled after warm-up"

    # A late row (asynchronous steps): its token, still on the device, is written into the
    # compiled step's inputs before the forward, as into the eager step's.
    sizes.clear()
    rows = decode_rows(
        [(prompt, [], len(prompt) - 1, list(range(i * 20, i * 20 + 20)))
         for i, prompt in enumerate(PROMPTS)],
        tokens_per_block=tokens_per_block,
    )  # fmt: skip
    late = attrs.evolve(rows, token_ids=[rows.token_ids[0], 0, rows.token_ids[2]], late=(1,))
    sampled = torch.tensor([rows.token_ids[1], 7])

    def patch(batch: ForwardBatch) -> None:
        fill_late(batch.input_ids, torch.tensor([1]), sampled, torch.tensor([0]))

    with torch.inference_mode():
        patched = fast._decode(late, patch)
        fast.compiled = None
        want = fast._decode(rows, None)
    assert sizes == [3]
    torch.testing.assert_close(
        patched, want, rtol=1e-4, atol=1e-4 if dtype == torch.float32 else 0.05
    )

    eager = runner_greedy(runner(), PROMPTS, NEW_TOKENS)
    model = load()
    tol = NEAR_TIE if dtype == torch.float32 else BF16_NEAR_TIE
    for i, prompt in enumerate(PROMPTS):
        margins: list[float] = []
        reference = PagedGreedy.single(model).generate(prompt, NEW_TOKENS, margins=margins)
        assert_greedy_match(eager[i], reference, margins, tol)
        assert_greedy_match(together[i], reference, margins, tol)
        assert_greedy_match(alone[i], reference, margins, tol)
