"""Mixed-step CUDA graphs and asynchronous steps on the device (run on the device machine).

* Greedy tokens of steps replayed from the token-bucket graphs (prefill chunks next to decode
  rows) equal the eager steps' (bf16, near-tie rule), and every such step was replayed.
* The asynchronous loop (step N+1 launched before step N's tokens reach the host, its decode
  rows reading them on the device) gives the synchronous loop's tokens, with graphs on.
* No Triton kernel compiles while a mixed load runs after start-up.
* The graphs' device memory is measured and bounded.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from tests.oracle import PagedGreedy, assert_greedy_match, make_hf_checkpoint
from tests.runner_greedy import runner_greedy
from trtdisagg.config import KvCacheConfig, WorkerConfig
from trtdisagg.metrics import WorkerMetrics
from trtdisagg.model.loader import load_model
from trtdisagg.model.parallel import Parallel
from trtdisagg.model.triton_ops import compiled_variants
from trtdisagg.worker.engine.build import assemble_executor
from trtdisagg.worker.engine.wakeup import Wakeup
from trtdisagg.worker.request import Request, SamplingParams
from trtdisagg.worker.runner import ModelRunner, build_runner
from trtdisagg.worker.tokenization import Tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16_NEAR_TIE = 0.25  # as tests/gpu/test_gpu_model.py
NEW_TOKENS = 16
PROMPTS = [[(7 * i + 3 * k) % 1900 + 7 for i in range(n)] for k, n in enumerate((37, 9, 130, 64))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(
        tmp_path_factory.mktemp("big_llama"),
        "llama",
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1408,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        rope_llama3=True,
        initializer_range=0.05,
    )


def config(*, cuda_graphs: bool, **extra: Any) -> WorkerConfig:
    return WorkerConfig(
        device="cuda",
        dtype="bfloat16",
        max_batch_size=8,
        max_num_tokens=256,
        cuda_graphs=cuda_graphs,
        kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=16384),
        **extra,
    )


@pytest.fixture(scope="module")
def graphed(checkpoint: Path) -> ModelRunner:
    return build_runner(config(cuda_graphs=True), checkpoint, Parallel())


@pytest.fixture(scope="module")
def references(checkpoint: Path) -> list[tuple[list[int], list[float]]]:
    model = load_model(checkpoint, dtype=torch.bfloat16, device=torch.device("cuda"),
                       parallel=Parallel())  # fmt: skip
    refs = []
    for prompt in PROMPTS:
        margins: list[float] = []
        driver = PagedGreedy.single(model, tokens_per_block=16, num_blocks=64)
        refs.append((driver.generate(prompt, NEW_TOKENS, margins=margins), margins))
    return refs


def test_mixed_step_graphs_give_the_eager_tokens(
    checkpoint: Path, graphed: ModelRunner, references: list[tuple[list[int], list[float]]]
) -> None:
    assert graphed.step_graphs is not None and graphed.step_graphs.captured_buckets[-1] == 256
    before = graphed.step_graphs.replays
    ours = runner_greedy(graphed, PROMPTS, NEW_TOKENS, stagger=True)
    # Prompts join one per step: the first step prefills alone, the next three prefill next to
    # decodes; all four are replayed from the bucket graphs.
    assert graphed.step_graphs.replays - before == len(PROMPTS)
    eager_runner = build_runner(config(cuda_graphs=False), checkpoint, Parallel())
    assert eager_runner.step_graphs is None
    eager = runner_greedy(eager_runner, PROMPTS, NEW_TOKENS, stagger=True)
    compared = 0
    for i, (ref, margins) in enumerate(references):
        compared += assert_greedy_match(ours[i], ref, margins, BF16_NEAR_TIE)
        assert_greedy_match(eager[i], ref, margins, BF16_NEAR_TIE)
    assert compared >= NEW_TOKENS


async def run_loop(runner: ModelRunner, checkpoint: Path, *, overlap: bool) -> list[list[int]]:
    executor = assemble_executor(
        config(cuda_graphs=True, async_scheduling=overlap),
        runner=runner,
        tokenizer=Tokenizer.from_dir(checkpoint),
        metrics=WorkerMetrics.create(),
        wakeup=Wakeup(),
    )
    handles = []
    for i, prompt in enumerate(PROMPTS):
        request = Request(
            request_id=i,
            prompt_token_ids=list(prompt),
            sampling=SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
            arrival_time=time.monotonic(),
        )
        handles.append(executor.submit(request))
    with trio.fail_after(120):
        await executor.loop.run_until_idle()
    tokens = []
    for handle in handles:
        got: list[int] = []
        async for out in handle.outputs:
            got.extend(out.token_ids)
        tokens.append(got)
    pool = executor.scheduler.statistics().pool
    assert pool.free_blocks + pool.reusable_blocks == pool.total_blocks
    return tokens


async def test_async_steps_give_the_synchronous_tokens(
    checkpoint: Path, graphed: ModelRunner, references: list[tuple[list[int], list[float]]]
) -> None:
    ours = await run_loop(graphed, checkpoint, overlap=True)
    sync = await run_loop(graphed, checkpoint, overlap=False)
    for i, (ref, margins) in enumerate(references):
        assert_greedy_match(ours[i], ref, margins, BF16_NEAR_TIE)
        assert_greedy_match(sync[i], ref, margins, BF16_NEAR_TIE)


async def test_nothing_compiles_under_a_mixed_load(checkpoint: Path, graphed: ModelRunner) -> None:
    before = compiled_variants()
    await run_loop(graphed, checkpoint, overlap=True)
    eager_runner = build_runner(config(cuda_graphs=False), checkpoint, Parallel())
    warmed = compiled_variants()
    await run_loop(eager_runner, checkpoint, overlap=True)
    assert compiled_variants() == warmed == before


def test_graph_memory_is_measured(graphed: ModelRunner) -> None:
    assert graphed.step_graphs is not None
    used = graphed.step_graphs.memory_bytes
    # Activations of the largest bucket (256 tokens of a 512-wide model), shared by every graph.
    assert 0 < used < 512 * 2**20, used
