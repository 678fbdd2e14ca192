"""Build `AttentionMeta` (the paged attention kernel's view of a step) from host lists, from a
batch's `SeqSlice`s, or from a decode step's `DecodeMeta`.

`from_lists` is what a runner that pads steps to size buckets uses: one int32 host buffer, one
copy to the device, sequences padded with q_len 0 and the table to a fixed width. `for_batch`
serves the batches that come without it: it never reads device memory on the host, so it adds
no sync to a step (on CUDA: one copy from pinned memory, a concatenation and a gather).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trtdisagg.model.batch import AttentionMeta, DecodeMeta, ForwardBatch, SeqSlice


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _split(packed: torch.Tensor, num_seqs: int, width: int, *, max_q_len: int) -> AttentionMeta:
    """The meta over one packed int32 buffer: cu_q, kv_lens, live, then the table."""
    s = num_seqs
    return AttentionMeta(
        cu_q=packed[: s + 1],
        kv_lens=packed[s + 1 : 2 * s + 1],
        live=packed[2 * s + 1 : 2 * s + 2],
        block_table=packed[2 * s + 2 : 2 * s + 2 + s * width].view(s, width),
        max_q_len=max_q_len,
    )


def from_lists(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    device: torch.device,
    num_seqs: int | None = None,
    width: int | None = None,
    max_q_len: int | None = None,
) -> AttentionMeta:
    """Sequences given on the host, in flat-batch order (sequence i's queries follow i-1's).

    `num_seqs` pads with q_len-0 sequences and `width` fixes the table width (both for a size
    bucket); `max_q_len` overrides the bound (a bucket's, so that every step of it launches the
    same variant). Table rows are padded with block 0, which is never read.
    """
    count = len(q_lens)
    if not count == len(kv_lens) == len(block_tables):
        raise ValueError("q_lens, kv_lens and block_tables need one entry per sequence")
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        if not 0 <= q_len <= kv_len:
            raise ValueError(f"need 0 <= q_len <= kv_len, got q_len {q_len}, kv_len {kv_len}")
    s = count if num_seqs is None else num_seqs
    w = max((len(t) for t in block_tables), default=1) if width is None else width
    w = max(w, 1)
    if s < count or any(len(t) > w for t in block_tables):
        raise ValueError(f"{count} sequences of up to {w} blocks do not fit {s} x {w}")
    cu_q = [0]
    for q_len in q_lens:
        cu_q.append(cu_q[-1] + q_len)
    cu_q += [cu_q[-1]] * (s - count)
    lens = list(kv_lens) + [0] * (s - count)
    table: list[int] = []
    for blocks in block_tables:
        table.extend(blocks)
        table.extend([0] * (w - len(blocks)))
    table.extend([0] * (w * (s - count)))
    host = torch.tensor(cu_q + lens + [count] + table, dtype=torch.int32)
    bound = max(q_lens, default=0) if max_q_len is None else max_q_len
    return _split(_to_device(host, device), s, w, max_q_len=bound)


def from_seqs(seqs: Sequence[SeqSlice], device: torch.device) -> AttentionMeta:
    """The batch's sequences, whose block ids are already on the device."""
    if not seqs:
        raise ValueError("a batch without sequences has no attention")
    position = 0
    for seq in seqs:
        if seq.q_start != position:
            raise ValueError(
                f"sequences must be packed in order: one starts at token {seq.q_start}, "
                f"expected {position}"
            )
        position += seq.q_len
    s = len(seqs)
    counts = [int(seq.block_ids.shape[0]) for seq in seqs]
    width = max(max(counts), 1)
    # Row i of the table gathers from the concatenated block ids: entries past a sequence's own
    # blocks repeat its last one (never read by the kernel, but a valid id).
    index: list[int] = []
    offset = 0
    for count in counts:
        last = offset + max(count - 1, 0)
        index.extend(min(offset + j, last) for j in range(width))
        offset += count
    cu_q = [seq.q_start for seq in seqs] + [position]
    lens = [seq.kv_len for seq in seqs]
    packed = _to_device(torch.tensor(cu_q + lens + [s] + index, dtype=torch.int32), device)
    flat = torch.cat([seq.block_ids for seq in seqs]) if s > 1 else seqs[0].block_ids
    gather = packed[2 * s + 2 :]
    table = flat.index_select(0, gather).to(torch.int32).view(s, width)
    return AttentionMeta(
        cu_q=packed[: s + 1],
        kv_lens=packed[s + 1 : 2 * s + 1],
        live=packed[2 * s + 1 : 2 * s + 2],
        block_table=table,
        max_q_len=max(seq.q_len for seq in seqs),
    )


def from_decode(meta: DecodeMeta) -> AttentionMeta:
    """A decode step (row i is sequence i's one token); runs inside a CUDA graph capture too."""
    s = meta.block_table.shape[0]
    device = meta.block_table.device
    cu_q = torch.arange(s + 1, dtype=torch.int32, device=device)
    return AttentionMeta(
        cu_q=cu_q,
        kv_lens=meta.context_lens.to(torch.int32),
        live=cu_q[s:],  # every row counts (a padding row has context length 0)
        block_table=meta.block_table.to(torch.int32),
        max_q_len=1,
    )


def for_batch(batch: ForwardBatch) -> AttentionMeta:
    """The batch's own `attention`, else one built from `decode` or `seqs`."""
    if batch.attention is not None:
        return batch.attention
    if batch.decode is not None:
        return from_decode(batch.decode)
    return from_seqs(batch.seqs, batch.input_ids.device)
