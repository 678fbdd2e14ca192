"""Decode steps on CUDA: inputs staged in one pinned buffer, and CUDA graphs per batch size.

A decode-only step (every scheduled request computes one token) needs, per sequence, its token,
position, KV slot, context length and block table row. `DecodeStaging` writes them into one
int32 host buffer (pinned on CUDA) and sends it in one non-blocking copy; the `ForwardBatch` it
returns is made of views of the device twin, with `DecodeMeta` set so attention runs batched.

`DecodeGraphs` captures the whole decode forward (embedding to logits) once per batch size
(1, 2, 4, ... 64, padded up), each over its own staging buffers. Padding rows have slot -1 and
context length 0: they write no KV and attend to nothing. The graphs need operations that read
lengths from device memory only (`ops.graph_safe`, i.e. the Triton kernels), one process per
model (no TP/PP collectives inside), and a block-table width fixed at capture: the blocks of
`max_seq_len` tokens. A step that does not fit (more sequences, longer tables) runs eagerly.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Iterable, Sequence

import attrs
import torch

from trtdisagg.kv.cache import KVCache
from trtdisagg.model.batch import DecodeMeta, ForwardBatch
from trtdisagg.model.llama import CausalLM
from trtdisagg.worker.graph_capture import capture_graph

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
PAD_SLOT = -1


@attrs.frozen(kw_only=True)
class DecodeRows:
    """One decode step's inputs, one entry per sequence."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]  # each row's blocks (at least ceil(context_len / T))
    # Rows whose token is still in flight (asynchronous steps): 0 here, written on the device.
    late: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def max_blocks(self) -> int:
        return max((len(t) for t in self.block_tables), default=0)


@attrs.define(eq=False, kw_only=True)
class DecodeStaging:
    """Host and device buffers for decode steps of up to `capacity` sequences of at most
    `width` blocks each. Layout (int32): ids, positions, slots, lengths ([capacity] each), then
    the block table [capacity, width]."""

    capacity: int
    width: int
    tokens_per_block: int
    host: torch.Tensor
    device_buffer: torch.Tensor
    batch: ForwardBatch
    _copied: torch.cuda.Event | None = attrs.field(default=None, alias="copied")

    @classmethod
    def allocate(
        cls, capacity: int, width: int, *, tokens_per_block: int, device: torch.device
    ) -> DecodeStaging:
        size = capacity * (4 + width)
        on_cuda = device.type == "cuda"
        host = torch.zeros(size, dtype=torch.int32, pin_memory=on_cuda)
        dev = torch.zeros(size, dtype=torch.int32, device=device) if on_cuda else host
        c = capacity
        batch = ForwardBatch(
            input_ids=dev[0:c],
            positions=dev[c : 2 * c],
            slot_mapping=dev[2 * c : 3 * c],
            seqs=(),
            logits_indices=torch.arange(c, device=device),
            decode=DecodeMeta(
                block_table=dev[4 * c :].view(c, width),
                context_lens=dev[3 * c : 4 * c],
                max_context_len=width * tokens_per_block,
            ),
        )
        return cls(
            capacity=capacity,
            width=width,
            tokens_per_block=tokens_per_block,
            host=host,
            device_buffer=dev,
            batch=batch,
        )

    def fill(self, rows: DecodeRows) -> ForwardBatch:
        """Write `rows` (padding the rest) and start the copy to the device. Returns the batch,
        whose `max_context_len` is exact when the staging holds exactly `rows`."""
        n, c, w = len(rows), self.capacity, self.width
        if n > c or rows.max_blocks > w:
            raise ValueError(f"{n} rows of up to {rows.max_blocks} blocks exceed {c} x {w}")
        if self._copied is not None:
            self._copied.synchronize()  # the last copy out of `host` has finished
        h = self.host.numpy()
        h[0:n] = rows.token_ids
        h[n:c] = 0
        h[c : c + n] = rows.positions
        h[c + n : 2 * c] = 0
        h[2 * c : 2 * c + n] = rows.slots
        h[2 * c + n : 3 * c] = PAD_SLOT
        h[3 * c : 3 * c + n] = rows.context_lens
        h[3 * c + n : 4 * c] = 0
        table = h[4 * c :].reshape(c, w)
        for i, blocks in enumerate(rows.block_tables):
            table[i, : len(blocks)] = blocks
        if self.device_buffer is not self.host:
            used = 4 * c + n * w  # rows past n are padding and their table is never read
            self.device_buffer[:used].copy_(self.host[:used], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copied = event
        if n == c and n > 0:
            meta = self.batch.decode
            assert meta is not None
            exact = attrs.evolve(meta, max_context_len=max(rows.context_lens))
            return attrs.evolve(self.batch, decode=exact)
        return self.batch


def graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The graph sizes that a scheduler allowing `max_batch_size` sequences can use."""
    sizes = [b for b in GRAPH_BATCH_SIZES if b < max_batch_size]
    sizes += [b for b in GRAPH_BATCH_SIZES if b >= max_batch_size][:1]
    return tuple(sizes)


@attrs.define(eq=False, kw_only=True)
class _Captured:
    staging: DecodeStaging
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [size, vocab] float32, rewritten by each replay


@attrs.define(eq=False, kw_only=True)
class DecodeGraphs:
    model: CausalLM
    cache: KVCache
    batch_sizes: tuple[int, ...]
    max_blocks_per_seq: int
    _captured: dict[int, _Captured] = attrs.field(factory=dict, alias="captured")
    replays: int = 0  # decode steps served from a graph

    def capture(self) -> None:
        """Compile every kernel variant serving can meet (`CausalLM.warm_up`: eager and mixed
        steps too), then capture one graph per batch size, largest first, sharing one memory
        pool. Slow (seconds); call once before serving."""
        ops = self.model.ops
        if ops is None or not ops.graph_safe:
            raise ValueError("CUDA graphs need the model on graph-safe ops (TritonOps)")
        device = self.cache.device
        pool = torch.cuda.graph_pool_handle()
        empty = DecodeRows(token_ids=[], positions=[], slots=[], context_lens=[], block_tables=[])
        with torch.inference_mode(), torch.cuda.device(device):
            self.model.warm_up(self.cache)
            for size in sorted(self.batch_sizes, reverse=True):
                staging = DecodeStaging.allocate(
                    size,
                    self.max_blocks_per_seq,
                    tokens_per_block=self.cache.tokens_per_block,
                    device=device,
                )
                batch = staging.fill(empty)  # all padding: writes nothing, attends to nothing
                forward = functools.partial(self.model, batch, self.cache)
                graph, logits = capture_graph(forward, rows=size, pool=pool, device=device)
                self._captured[size] = _Captured(staging=staging, graph=graph, logits=logits)
            torch.cuda.synchronize(device)

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._captured))

    def fits(self, rows: DecodeRows) -> bool:
        sizes = self.captured_sizes
        return bool(sizes) and len(rows) <= sizes[-1] and rows.max_blocks <= self.max_blocks_per_seq

    def run(
        self, rows: DecodeRows, before_replay: Callable[[ForwardBatch], None] | None = None
    ) -> torch.Tensor | None:
        """Logits [len(rows), vocab] from the smallest graph that holds `rows`; None if none
        does. The tensor is the graph's output buffer: read it before the next call.
        `before_replay` gets the graph's input batch once the rows are in (late tokens)."""
        if not self.fits(rows):
            return None
        sizes = self.captured_sizes
        size = sizes[bisect.bisect_left(sizes, len(rows))]
        captured = self._captured[size]
        batch = captured.staging.fill(rows)
        if before_replay is not None:
            before_replay(batch)
        captured.graph.replay()
        self.replays += 1
        return captured.logits[: len(rows)]


def decode_rows(
    requests: Iterable[tuple[Sequence[int], Sequence[int], int, Sequence[int]]],
    tokens_per_block: int,
) -> DecodeRows:
    """DecodeRows from (prompt ids, output ids, num_computed_tokens, block ids) per sequence:
    each computes the token at position `num_computed_tokens`. A position just past the known
    tokens is a token still in flight: the row is listed in `late`."""
    tpb = tokens_per_block
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    lens: list[int] = []
    tables: list[list[int]] = []
    late: list[int] = []
    for prompt, output, pos, blocks in requests:
        p = len(prompt)
        if pos < p:
            token_ids.append(prompt[pos])
        elif pos - p < len(output):
            token_ids.append(output[pos - p])
        elif pos - p == len(output):
            late.append(len(token_ids))
            token_ids.append(0)
        else:
            raise ValueError(f"position {pos} is past the {p + len(output)} known tokens + 1")
        positions.append(pos)
        used = list(blocks[: pos // tpb + 1])
        if len(used) * tpb <= pos:
            raise ValueError(f"{len(blocks)} blocks cannot hold position {pos}")
        slots.append(used[-1] * tpb + pos % tpb)
        lens.append(pos + 1)
        tables.append(used)
    return DecodeRows(
        token_ids=token_ids,
        positions=positions,
        slots=slots,
        context_lens=lens,
        block_tables=tables,
        late=tuple(late),
    )


def blocks_for(max_seq_len: int, tokens_per_block: int, num_blocks: int) -> int:
    """Block-table width for sequences of up to `max_seq_len` tokens in a pool of `num_blocks`."""
    return max(1, min(math.ceil(max_seq_len / tokens_per_block), num_blocks))
