"""The forward contract: what the runner hands the model for one step.

Flat-token layout: the new tokens of every sequence in the step are concatenated into one
dimension of N tokens. Embeddings, norms, projections and the MLP run over all N at once;
attention runs per sequence, against that sequence's paged KV (`SeqSlice.block_ids`).

A sequence's new tokens are positions `[kv_len - q_len, kv_len)`: prefill chunks, decode steps
(`q_len == 1`) and tails after a prefix-cache hit all look the same to the model.

Decode-only steps (every `q_len == 1`) may instead carry `DecodeMeta`: one padded block table for
the whole batch, so attention runs batched instead of once per sequence. Such a batch's `seqs` may
be empty; row i of every per-token tensor is then sequence i.

A mixed step (prefill chunks next to decodes) may carry `decode_head`: `DecodeMeta` for its first
`S` sequences when each has `q_len == 1` (rows 0..S-1). Those attend batched and only the rest
one sequence at a time; the scheduler puts decodes first, so a burst of new prompts no longer
turns every running stream's attention into a per-sequence loop.

`attention` (`AttentionMeta`) describes the whole step to the paged attention kernel on device
(int32 offsets, lengths and block table): with it every step, of any mix, attends in one launch.
A runner may fill it (padded to a size bucket, for a CUDA graph); otherwise the Triton ops build
it from `seqs` or `decode` (`trtdisagg.model.attention_meta`).
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(kw_only=True, eq=False)
class SeqSlice:
    q_start: int  # offset of this sequence's new tokens in the flat token tensors
    q_len: int  # new tokens this step (prefill chunk length, or 1 for decode)
    kv_len: int  # tokens in KV after this step (= tokens already cached + q_len)
    block_ids: torch.Tensor  # long [ceil(kv_len / tokens_per_block)] on the model device

    def __attrs_post_init__(self) -> None:
        if not 0 < self.q_len <= self.kv_len:
            raise ValueError(
                f"need 0 < q_len <= kv_len, got q_len {self.q_len}, kv_len {self.kv_len}"
            )


@attrs.frozen(kw_only=True, eq=False)
class DecodeMeta:
    """Batched attention metadata of a decode-only step: sequence i's one new token is row i.

    Only the first `ceil(context_lens[i] / tokens_per_block)` entries of row i of `block_table` are
    read. Rows with `context_lens == 0` are padding (CUDA-graph batch sizes): they attend to
    nothing and must come with `slot_mapping == -1`, which writes nothing (Triton kernels only).
    """

    block_table: torch.Tensor  # int32 or int64 [S, W], padded with any valid block id
    context_lens: torch.Tensor  # int32 or int64 [S]: kv_len of each sequence, this token included
    max_context_len: int  # host-side bound on context_lens, at most W * tokens_per_block


@attrs.frozen(kw_only=True, eq=False)
class AttentionMeta:
    """A step's sequences as the paged attention kernel reads them: int32 tensors on the device.

    Sequence s owns query rows `cu_q[s]..cu_q[s+1]` of the flat batch and `kv_lens[s]` keys, held
    in the first `ceil(kv_lens[s] / tokens_per_block)` entries of `block_table[s]`. Padding
    sequences have q_len 0 (`cu_q` repeats its last value); tokens past `cu_q[S]` are padding
    too, and their attention output is left unwritten. A sequence with kv_len 0 attends to
    nothing (output 0). Only the first `live[0]` sequences may be real: a size bucket pads a step
    of a few sequences to dozens, and the kernel's programs for the padding stop at once.
    """

    cu_q: torch.Tensor  # int32 [S + 1], non-decreasing, cu_q[0] == 0
    kv_lens: torch.Tensor  # int32 [S], each >= q_len of its sequence
    block_table: torch.Tensor  # int32 [S, W], row stride may exceed W; entries past use unread
    live: torch.Tensor  # int32 [1]: sequences past live[0] are padding (q_len 0)
    max_q_len: int  # host-side bound on every q_len: it decides whether long tiles launch

    def __attrs_post_init__(self) -> None:
        for name in ("cu_q", "kv_lens", "block_table", "live"):
            if getattr(self, name).dtype != torch.int32:
                raise ValueError(f"AttentionMeta.{name} must be int32")
        if self.live.shape != (1,):
            raise ValueError(
                f"AttentionMeta.live must have shape [1], got {tuple(self.live.shape)}"
            )
        num_seqs = self.kv_lens.shape[0]
        if self.cu_q.shape != (num_seqs + 1,) or self.block_table.shape[0] != num_seqs:
            raise ValueError(
                f"AttentionMeta of {num_seqs} sequences needs cu_q [{num_seqs + 1}] and "
                f"block_table [{num_seqs}, W], got {tuple(self.cu_q.shape)} and "
                f"{tuple(self.block_table.shape)}"
            )
        if self.block_table.dim() != 2 or self.block_table.stride(1) != 1:
            raise ValueError("AttentionMeta.block_table must be 2-D with unit column stride")

    @property
    def num_seqs(self) -> int:
        return int(self.kv_lens.shape[0])


@attrs.frozen(kw_only=True, eq=False)
class ForwardBatch:
    input_ids: torch.Tensor  # long (or int32) [N], all sequences' new tokens, concatenated
    positions: torch.Tensor  # long (or int32) [N]
    # long (or int32) [N]: block_id * tokens_per_block + offset of each new K/V
    slot_mapping: torch.Tensor
    seqs: tuple[SeqSlice, ...]
    logits_indices: torch.Tensor  # long [S], flat index of each sequence's last new token
    decode: DecodeMeta | None = None  # set only when every sequence has q_len == 1
    decode_head: DecodeMeta | None = None  # mixed steps: the leading q_len == 1 sequences
    attention: AttentionMeta | None = None  # the whole step for the paged attention kernel

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
