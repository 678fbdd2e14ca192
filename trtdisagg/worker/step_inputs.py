"""A step's inputs as tensors: the flat batch of a plan, and the tokens it takes from the device.

`plan_inputs` turns a scheduler plan into explicit per-request inputs (`ItemInputs`, what rank 0
of a multi-rank instance broadcasts). With asynchronous steps a decode row's token may still be
in flight: the step before samples it, and it is on the device only. Such a row gets token 0 on
the host and is listed as late (`LateRow`); the runner copies the token in on the device, after
the inputs' copy and before the forward, in stream order (`fill_late`).

`build_batch` packs a step's integers into one host tensor, sent in one copy, and slices the
`ForwardBatch` out of it: flat tokens, positions, KV slots, each sequence's blocks, and, for a
mixed step, the leading decode rows' padded block table (`DecodeMeta` in `decode_head`).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from trtdisagg.kv.block_pool import BlockCopy
from trtdisagg.model.batch import DecodeMeta, ForwardBatch, SeqSlice
from trtdisagg.worker.decode_graphs import DecodeRows, decode_rows
from trtdisagg.worker.prompt_logprobs import wants_prompt_logprobs, with_prompt_targets
from trtdisagg.worker.rank_plan import ItemInputs, step_items
from trtdisagg.worker.step_plan import StepPlan


@attrs.frozen(kw_only=True)
class LateRow:
    """Input row `row` of a step takes the token that the step in flight samples for
    `request_id` (a decode row whose last token is not known on the host yet)."""

    row: int
    request_id: int


@attrs.frozen(kw_only=True)
class StepInputs:
    """A step's host-side inputs, taken from its plan before it launches: from then on the loop
    may change the plan's requests (append the previous step's tokens) while the step runs."""

    rows: tuple[tuple[int, bool], ...]  # per item: (request id, whether it samples)
    items: tuple[ItemInputs, ...] = ()  # a flat-batch step's items
    decode: DecodeRows | None = None  # a decode-only step attending batched (its rows instead)
    late: tuple[LateRow, ...] = ()
    copies: tuple[BlockCopy, ...] = ()  # the plan's copy-on-write, before the forward
    prompt_logprobs: bool = False  # an item computes prompt logprobs (extra logits rows)


def step_inputs(plan: StepPlan, tokens_per_block: int, *, batched_decode: bool) -> StepInputs:
    """The inputs of a plan: its decode rows when every item computes one token and decode
    attends batched, else its flat-batch items."""
    rows = tuple((item.request.request_id, item.samples) for item in plan.items)
    prompt = any(wants_prompt_logprobs(item.request) for item in plan.items)
    if (
        batched_decode
        and plan.items
        and not prompt
        and all(i.num_new_tokens == 1 for i in plan.items)
    ):
        decode = _decode_rows(plan, tokens_per_block)
        late = tuple(
            LateRow(row=row, request_id=plan.items[row].request.request_id) for row in decode.late
        )
        return StepInputs(rows=rows, decode=decode, late=late, copies=plan.copies)
    items, late = plan_inputs(plan, tokens_per_block)
    return StepInputs(rows=rows, items=items, late=late, copies=plan.copies, prompt_logprobs=prompt)


def _decode_rows(plan: StepPlan, tokens_per_block: int) -> DecodeRows:
    entries = []
    for item in plan.items:
        request = item.request
        table = request.block_table
        assert table is not None, f"request {request.request_id} scheduled without blocks"
        entries.append(
            (
                request.prompt_token_ids,
                request.output_token_ids,
                request.num_computed_tokens,
                table.block_ids,
            )
        )
    return decode_rows(entries, tokens_per_block)


def plan_inputs(
    plan: StepPlan, tokens_per_block: int
) -> tuple[tuple[ItemInputs, ...], tuple[LateRow, ...]]:
    """The plan's items as explicit inputs, and the rows whose token comes from the device.

    A late token is always a decode's one token: a preempted request is admitted again only once
    its pending token is known (`Scheduler`), so no prefill chunk holds one.
    """
    entries = []
    late = []
    row = 0
    for item in plan.items:
        request = item.request
        table = request.block_table
        assert table is not None, f"request {request.request_id} scheduled without blocks"
        start = request.num_computed_tokens
        end = start + item.num_new_tokens
        prompt, outputs = request.prompt_token_ids, request.output_token_ids
        # Slice without copying the whole sequence: a decode step needs one token.
        p = len(prompt)
        new_tokens = prompt[start:end] + outputs[max(start - p, 0) : max(end - p, 0)]
        if len(new_tokens) < item.num_new_tokens:
            if item.num_new_tokens != 1 or start != request.num_known_tokens:
                raise AssertionError(
                    f"request {request.request_id}: tokens [{start}, {end}) scheduled with "
                    f"{request.num_known_tokens} known; only a decode's one token may be pending"
                )
            late.append(LateRow(row=row, request_id=request.request_id))
            new_tokens = [0]  # written on the device before the forward (`fill_late`)
        row += item.num_new_tokens
        entries.append(
            (request.request_id, tuple(new_tokens), start, tuple(table.block_ids), item.samples)
        )
    built = step_items(entries, tokens_per_block)
    if any(wants_prompt_logprobs(item.request) for item in plan.items):
        built = tuple(
            with_prompt_targets(inputs, item.request)
            if wants_prompt_logprobs(item.request)
            else inputs
            for inputs, item in zip(built, plan.items, strict=True)
        )
    return built, tuple(late)


def plan_items(plan: StepPlan, tokens_per_block: int) -> tuple[ItemInputs, ...]:
    """A plan whose every token is known, as explicit inputs (multi-rank steps are synchronous)."""
    items, late = plan_inputs(plan, tokens_per_block)
    if late:
        raise AssertionError(f"{len(late)} rows with a pending token in a synchronous step")
    return items


def fill_late(
    input_ids: torch.Tensor,
    rows: torch.Tensor,
    sampled: torch.Tensor,
    sources: torch.Tensor,
) -> None:
    """input_ids[rows[i]] = sampled[sources[i]], on the device (`rows`, `sources`: int64)."""
    input_ids.index_copy_(0, rows, sampled.index_select(0, sources).to(input_ids.dtype))


def build_batch(
    items: Sequence[ItemInputs],
    device: torch.device,
    *,
    tokens_per_block: int,
    batched_decode: bool,
) -> ForwardBatch:
    """The flat-token batch of `items`; with `batched_decode`, a mixed step's leading decode
    rows attend batched (`decode_head`)."""
    tpb = tokens_per_block
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    spans: list[tuple[int, int, int, int]] = []  # q_start, q_len, kv_len, blocks
    blocks_flat: list[int] = []
    logits_indices: list[int] = []
    for item in items:
        start, end, blocks = item.start, item.end, item.block_ids
        q_start = len(input_ids)
        input_ids.extend(item.token_ids)
        positions.extend(range(start, end))
        slots.extend(blocks[p // tpb] * tpb + p % tpb for p in range(start, end))
        spans.append((q_start, end - start, end, len(blocks)))
        blocks_flat.extend(blocks)
        logits_indices.append(len(input_ids) - 1)
    for item, (q_start, *_) in zip(items, spans, strict=True):
        # Prompt logprobs: the chunk's other positions that predict a prompt token.
        logits_indices.extend(range(q_start, q_start + item.num_extra_rows))

    head = _single_token_head(spans) if batched_decode else 0
    head_table, head_lens = _head_table(spans[:head], blocks_flat)
    # Everything in one tensor: one host-to-device copy per step.
    n, s = len(input_ids), len(logits_indices)
    packed = to_device(
        [
            *input_ids,
            *positions,
            *slots,
            *logits_indices,
            *blocks_flat,
            *head_table,
            *head_lens,
        ],
        device,
    )
    seqs: list[SeqSlice] = []
    offset = 3 * n + s
    for q_start, q_len, kv_len, num_blocks in spans:
        block_ids = packed[offset : offset + num_blocks]
        seqs.append(SeqSlice(q_start=q_start, q_len=q_len, kv_len=kv_len, block_ids=block_ids))
        offset += num_blocks
    decode_head = None
    if head:
        width = len(head_table) // head
        decode_head = DecodeMeta(
            block_table=packed[offset : offset + head * width].view(head, width),
            context_lens=packed[offset + head * width : offset + head * width + head],
            max_context_len=max(head_lens),
        )
    return ForwardBatch(
        input_ids=packed[:n],
        positions=packed[n : 2 * n],
        slot_mapping=packed[2 * n : 3 * n],
        seqs=tuple(seqs),
        logits_indices=packed[3 * n : 3 * n + s],
        decode_head=decode_head,
    )


def _single_token_head(spans: Sequence[tuple[int, int, int, int]]) -> int:
    """How many leading sequences of a mixed step have one new token (their rows are 0..k-1).

    0 when every sequence has one (a decode-only step has its own batched path) or when fewer
    than two lead: one sequence gains nothing from the batched kernel.
    """
    head = 0
    while head < len(spans) and spans[head][1] == 1:
        head += 1
    return 0 if head == len(spans) or head < 2 else head


def _head_table(
    spans: Sequence[tuple[int, int, int, int]], blocks_flat: Sequence[int]
) -> tuple[list[int], list[int]]:
    """The leading sequences' block ids as one padded [k, W] table (flattened) and their kv_lens.

    Rows are padded with their own first block: any valid id does, the kernel reads only the
    first ceil(kv_len / tokens_per_block) entries.
    """
    if not spans:
        return [], []
    width = max(num_blocks for *_, num_blocks in spans)
    table: list[int] = []
    offset = 0
    for *_, num_blocks in spans:
        row = list(blocks_flat[offset : offset + num_blocks])
        table.extend(row + [row[0]] * (width - num_blocks))
        offset += num_blocks
    return table, [kv_len for _, _, kv_len, _ in spans]


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 values on `device`: from pinned memory, without waiting, on CUDA."""
    if device.type == "cuda":
        host = torch.tensor(values, dtype=torch.long, pin_memory=True)
        return host.to(device, non_blocking=True)
    return torch.tensor(values, dtype=torch.long, device=device)
