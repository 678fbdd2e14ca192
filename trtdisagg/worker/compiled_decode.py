"""Decode steps on the CPU through `torch.compile` (the `cpu_compile` key).

On the CPU a small decode step costs what its ~40 op dispatches per layer do, not what they
compute. Compiled, the decode forward (embedding to logits, `TracedOps`) becomes a few fused
C++ kernels and library calls per layer. One graph serves every batch size and context length:
sizes are symbolic, except that torch specialises a size of 1, so a step of one sequence and a
step of several are two graphs, and the block table is at least `MIN_WIDTH` wide (a padded
entry reads a valid block, masked like any position past the context). `warm_up` compiles both
before serving, so no step compiles; the compiled code is cached on disk across starts
(torch's inductor cache).

Only one-rank instances compile (TP and PP collectives would have to be traced too), only
decode-only steps (prefill and mixed steps run eagerly: one per prompt chunk), and only steps
of up to `MAX_BATCH` sequences, where dispatch dominates.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.fx.experimental._config as shape_config

from trtdisagg.kv.cache import KVCache
from trtdisagg.model.batch import DecodeMeta, ForwardBatch
from trtdisagg.model.llama import CausalLM
from trtdisagg.model.traced_ops import TracedOps
from trtdisagg.worker.decode_graphs import DecodeRows

log = logging.getLogger(__name__)

MIN_WIDTH = 2  # block-table entries per sequence, at least (a width of 1 is another graph)
# Steps of more sequences run eagerly: there the compiled gather of each layer's context (an
# element-wise copy) costs more than compiling saves elsewhere, and eager attention gathers with
# `index_select` (docs/BENCHMARKS.md, "CPU serving").
MAX_BATCH = 8


class CompiledDecode:
    """The compiled decode forward of one model and KV pool."""

    def __init__(self, model: CausalLM, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self._ops = TracedOps()
        self._unused = torch.empty(0, dtype=torch.long)  # logits_indices: every row is a last
        torch._dynamo.mark_static(cache.pool)  # one pool: its sizes are no graph's variables
        # emulate_precision_casts: rounding as eager does (inductor otherwise keeps a fused chain
        # of bf16 ops in float32, and greedy tokens part from the eager step's and Hugging
        # Face's at near-ties). cpp_wrapper: the graph's calls are made from C++, not from a
        # Python wrapper, which a step this small pays for; and each graph is one C++ file to
        # compile, not one per kernel (docs/BENCHMARKS.md, "CPU serving").
        self._step: Callable[[ForwardBatch], torch.Tensor] = torch.compile(
            self._forward,
            dynamic=True,
            fullgraph=True,
            options={"emulate_precision_casts": True, "cpp_wrapper": True},
        )

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch, self.cache, ops=self._ops)

    def fits(self, rows: DecodeRows) -> bool:
        return len(rows) <= MAX_BATCH

    def batch(self, rows: DecodeRows) -> ForwardBatch:
        """The step's inputs as fresh tensors (views of one buffer would make the graph guard
        on their offsets)."""
        n = len(rows)
        table = np.zeros((n, max(rows.max_blocks, MIN_WIDTH)), dtype=np.int64)
        for i, blocks in enumerate(rows.block_tables):
            table[i, : len(blocks)] = blocks
        return ForwardBatch(
            input_ids=torch.tensor(rows.token_ids, dtype=torch.long),
            positions=torch.tensor(rows.positions, dtype=torch.long),
            slot_mapping=torch.tensor(rows.slots, dtype=torch.long),
            seqs=(),
            logits_indices=self._unused,
            decode=DecodeMeta(
                block_table=torch.from_numpy(table),
                context_lens=torch.tensor(rows.context_lens, dtype=torch.long),
                max_context_len=max(rows.context_lens),
            ),
        )

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits [S, vocab] of a batch made by `batch` (late tokens patched in)."""
        return self._step(batch)

    def warm_up(self) -> None:
        """Compile the one-sequence and the several-sequence graph. Their KV goes to the pool's
        first blocks, zeroed afterwards: call it before serving, when no block holds anything."""
        start = time.perf_counter()
        t = self.cache.tokens_per_block
        # Without duck sizing: a batch of 2 would tie the batch size to the table width (and to
        # any model dimension of 2), and every later step would have to repeat the coincidence.
        # (`patch` is added to the config module at import: mypy cannot see it.)
        no_duck_sizing = shape_config.patch(use_duck_shape=False)  # type: ignore[attr-defined]
        sizes = (1, 2)  # sequences: each uses 2 blocks
        with torch.inference_mode(), no_duck_sizing:
            for n in sizes:
                rows = DecodeRows(
                    token_ids=[0] * n,
                    positions=[t] * n,
                    slots=[(2 * i + 1) * t for i in range(n)],
                    context_lens=[t + 1] * n,
                    block_tables=[[2 * i, 2 * i + 1] for i in range(n)],
                )
                self(self.batch(rows))
            self.cache.pool[: 2 * max(sizes)].zero_()
        log.info(
            "compiled the CPU decode step (batch 1, and 2 and more) in %.1f s",
            time.perf_counter() - start,
        )
