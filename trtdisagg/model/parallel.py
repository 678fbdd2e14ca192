"""Parallel: which slice of the model one rank holds (tensor- and pipeline-parallel position).

Pure arithmetic: the loader and the model ask it which heads, rows and layers are local. The
process group is created by the worker, never here.

Head split under TP (`tp_size` ranks, `K` kv heads, `Q` query heads):
* query heads: rank r holds `[r * Q/tp, (r+1) * Q/tp)`;
* kv heads, `K >= tp`: rank r holds `[r * K/tp, (r+1) * K/tp)`;
* kv heads, `K < tp`: every rank holds ONE kv head, `r * K // tp`, so `tp / K` ranks hold a
  duplicate of each head. Those duplicates matter to KV transfer (only one owner writes a head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def pp_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """Global layers [start, end) of pipeline stage `pp_rank`: an even split, earlier stages
    taking one extra layer when `num_layers` is not a multiple of `pp_size`."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} outside [0, {pp_size})")
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


@attrs.frozen(kw_only=True)
class Parallel:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # All-reduce group of this rank's TP peers; None means the default group (when tp_size > 1).
    tp_group: ProcessGroup | None = attrs.field(default=None, eq=False, repr=False)
    device_index: int = 0  # CUDA device of this rank; ignored on CPU

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside [0, {self.tp_size})")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} outside [0, {self.pp_size})")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        return pp_layer_range(num_layers, self.pp_size, self.pp_rank)

    def even_range(self, total: int, *, what: str) -> tuple[int, int]:
        """This rank's share [start, end) of `total` units split evenly over TP ranks."""
        if total % self.tp_size:
            raise ValueError(
                f"{what} {total} is not divisible by tensor_parallel_size {self.tp_size}"
            )
        share = total // self.tp_size
        return self.tp_rank * share, (self.tp_rank + 1) * share

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """Global kv heads [start, end) held by this rank (one duplicated head when K < tp)."""
        if num_kv_heads >= self.tp_size:
            return self.even_range(num_kv_heads, what="num_key_value_heads")
        if self.tp_size % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size {self.tp_size} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        head = self.tp_rank * num_kv_heads // self.tp_size
        return head, head + 1
