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
class ForwardBatch:
    input_ids: torch.Tensor  # long (or int32) [N], all sequences' new tokens, concatenated
    positions: torch.Tensor  # long (or int32) [N]
    # long (or int32) [N]: block_id * tokens_per_block + offset of each new K/V
    slot_mapping: torch.Tensor
    seqs: tuple[SeqSlice, ...]
    logits_indices: torch.Tensor  # long [S], flat index of each sequence's last new token
    decode: DecodeMeta | None = None  # set only when every sequence has q_len == 1
    decode_head: DecodeMeta | None = None  # mixed steps: the leading q_len == 1 sequences

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
