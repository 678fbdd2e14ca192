"""Mixed and prefill steps on CUDA: one CUDA graph per token-count bucket.

A step that is not decode-only (prefill chunks, alone or next to decode rows) is padded to the
smallest bucket that holds its tokens and replayed from that bucket's graph, so a short prompt
costs its FLOPs, not its kernel launches. `StepStaging` holds a bucket's inputs in one int32
buffer (pinned on the host, one copy to the device): per token its id, position and KV slot; per
sequence the row of its last token and its paged attention metadata (`AttentionMeta`: offsets,
lengths, a block table of fixed width), and how many sequences are real. Padding tokens have
slot -1 (they write no KV) and padding sequences q_len 0 and kv_len 0 (they attend to nothing
and are never read back). The paged attention kernel reads every length from device memory and
its grid depends only on the bucket, so one graph serves every step of the bucket.

A graph ends at the final norm of each sequence's last token ([S, hidden], `CausalLM.forward`
with `logits=False`); the output head runs after the replay on the step's own sequences, so the
graphs hold no vocabulary-wide buffers. They share one memory pool (captured largest first),
which `capture` reports. A step larger than the largest bucket, with more sequences than a
bucket holds or longer block tables than its width, runs eagerly.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence

import attrs
import torch

from trtdisagg.kv.cache import KVCache
from trtdisagg.model.batch import AttentionMeta, ForwardBatch
from trtdisagg.model.llama import CausalLM
from trtdisagg.worker.graph_capture import capture_graph
from trtdisagg.worker.rank_plan import ItemInputs

PAD_SLOT = -1
FIRST_BUCKETS = (16, 32, 64)
FINE_STEP, FINE_UNTIL = 64, 1024  # buckets every 64 tokens up to 1024
COARSE_STEP = 256  # then every 256


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Token counts a graph is captured for, up to `max_tokens` (the last one is it, rounded up
    to a multiple of 16). Padding wastes at most a quarter of a step beyond 64 tokens, and none
    for the common prompt lengths (multiples of 64)."""
    if max_tokens <= 0:
        return ()
    sizes = list(FIRST_BUCKETS) + list(range(2 * FINE_STEP, FINE_UNTIL + 1, FINE_STEP))
    sizes += list(range(FINE_UNTIL + COARSE_STEP, max_tokens + COARSE_STEP, COARSE_STEP))
    top = -(-max_tokens // 16) * 16
    return tuple(sorted({s for s in sizes if s < top} | {top}))


@attrs.define(eq=False, kw_only=True)
class StepStaging:
    """Host and device buffers of one bucket: `tokens` tokens, `seqs` sequences of at most
    `width` blocks. Layout (int32): ids, positions, slots ([tokens] each), last-token rows
    [seqs], cu_q [seqs + 1], kv_lens [seqs], live [1], block table [seqs, width]."""

    tokens: int
    seqs: int
    width: int
    tokens_per_block: int
    host: torch.Tensor
    device_buffer: torch.Tensor
    batch: ForwardBatch
    _copied: torch.cuda.Event | None = attrs.field(default=None, alias="copied")

    @classmethod
    def allocate(
        cls, tokens: int, seqs: int, width: int, *, tokens_per_block: int, device: torch.device
    ) -> StepStaging:
        size = 3 * tokens + 3 * seqs + 2 + seqs * width
        on_cuda = device.type == "cuda"
        host = torch.zeros(size, dtype=torch.int32, pin_memory=on_cuda)
        dev = torch.zeros(size, dtype=torch.int32, device=device) if on_cuda else host
        n, s = tokens, seqs
        meta = 3 * n + s
        attention = AttentionMeta(
            cu_q=dev[meta : meta + s + 1],
            kv_lens=dev[meta + s + 1 : meta + 2 * s + 1],
            live=dev[meta + 2 * s + 1 : meta + 2 * s + 2],
            block_table=dev[meta + 2 * s + 2 :].view(s, width),
            max_q_len=tokens,  # every step of the bucket launches the same kernel variant
        )
        batch = ForwardBatch(
            input_ids=dev[0:n],
            positions=dev[n : 2 * n],
            slot_mapping=dev[2 * n : 3 * n],
            seqs=(),
            logits_indices=dev[3 * n : meta],
            attention=attention,
        )
        return cls(
            tokens=tokens,
            seqs=seqs,
            width=width,
            tokens_per_block=tokens_per_block,
            host=host,
            device_buffer=dev,
            batch=batch,
        )

    def fits(self, items: Sequence[ItemInputs]) -> bool:
        return (
            sum(len(i.token_ids) for i in items) <= self.tokens
            and len(items) <= self.seqs
            and all(len(i.block_ids) <= self.width for i in items)
        )

    def fill(self, items: Sequence[ItemInputs]) -> ForwardBatch:
        """Write `items` (padding the rest) and start the copy to the device."""
        if not self.fits(items):
            raise ValueError(
                f"{len(items)} sequences do not fit a bucket of {self.tokens} tokens, "
                f"{self.seqs} sequences of {self.width} blocks"
            )
        if self._copied is not None:
            self._copied.synchronize()  # the last copy out of `host` has finished
        n, s, w, tpb = self.tokens, self.seqs, self.width, self.tokens_per_block
        h = self.host.numpy()
        meta = 3 * n + s
        h[: meta + 2 * s + 1] = 0
        h[2 * n : 3 * n] = PAD_SLOT
        h[meta + 2 * s + 1] = len(items)
        table = h[meta + 2 * s + 2 :].reshape(s, w)
        row = 0
        for i, item in enumerate(items):
            q_len, start = len(item.token_ids), item.start
            h[row : row + q_len] = item.token_ids
            h[n + row : n + row + q_len] = range(start, start + q_len)
            blocks = item.block_ids
            h[2 * n + row : 2 * n + row + q_len] = [
                blocks[p // tpb] * tpb + p % tpb for p in range(start, start + q_len)
            ]
            row += q_len
            h[3 * n + i] = row - 1
            h[meta + i + 1] = row
            h[meta + s + 1 + i] = item.end
            table[i, : len(blocks)] = blocks
        h[meta + len(items) + 1 : meta + s + 1] = row  # padding sequences: q_len 0
        if self.device_buffer is not self.host:
            used = meta + 2 * s + 2 + len(items) * w  # padding rows of the table are never read
            self.device_buffer[:used].copy_(self.host[:used], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copied = event
        return self.batch


@attrs.define(eq=False, kw_only=True)
class _Captured:
    staging: StepStaging
    graph: torch.cuda.CUDAGraph
    last: torch.Tensor  # [seqs, hidden]: the final norm of each sequence's last token


@attrs.define(eq=False, kw_only=True)
class StepGraphs:
    model: CausalLM
    cache: KVCache
    buckets: tuple[int, ...]
    max_seqs: int  # sequences per step (the scheduler's max_batch_size)
    max_blocks_per_seq: int
    _captured: dict[int, _Captured] = attrs.field(factory=dict, alias="captured")
    replays: int = 0  # steps served from a graph
    memory_bytes: int = 0  # device memory the captures took (measured)

    def capture(self) -> None:
        """Capture one graph per bucket, largest first, in one memory pool. Call after the
        model's warm-up (every kernel variant compiled), once, before serving."""
        ops = self.model.ops
        if ops is None or not ops.graph_safe:
            raise ValueError("CUDA graphs need the model on graph-safe ops (TritonOps)")
        device = self.cache.device
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        with torch.inference_mode(), torch.cuda.device(device):
            for tokens in sorted(self.buckets, reverse=True):
                staging = StepStaging.allocate(
                    tokens,
                    min(self.max_seqs, tokens),
                    self.max_blocks_per_seq,
                    tokens_per_block=self.cache.tokens_per_block,
                    device=device,
                )
                batch = staging.fill(())  # all padding: writes nothing, attends to nothing
                forward = functools.partial(self.model, batch, self.cache, logits=False)
                graph, last = capture_graph(forward, rows=tokens, pool=pool, device=device)
                self._captured[tokens] = _Captured(staging=staging, graph=graph, last=last)
            torch.cuda.synchronize(device)
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._captured))

    def run(
        self,
        items: Sequence[ItemInputs],
        before_replay: Callable[[ForwardBatch], None] | None = None,
    ) -> torch.Tensor | None:
        """Logits [len(items), vocab] of a step from the smallest bucket that holds it; None if
        none does. `before_replay` gets the bucket's input batch once the step is in."""
        num_tokens = sum(len(i.token_ids) for i in items)
        buckets = self.captured_buckets
        at = bisect.bisect_left(buckets, num_tokens)
        if at == len(buckets):
            return None
        captured = self._captured[buckets[at]]
        if not captured.staging.fits(items):
            return None
        batch = captured.staging.fill(items)
        if before_replay is not None:
            before_replay(batch)
        captured.graph.replay()
        self.replays += 1
        return self.model.head(captured.last[: len(items)])
