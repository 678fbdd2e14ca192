"""Capture one CUDA graph of a forward: warm runs on a side stream, then the capture.

Shared by the decode graphs (`decode_graphs.py`) and the mixed-step graphs (`step_graphs.py`).
The warm runs happen on a side stream because capture requires it of the first runs of cuBLAS
and of the caching allocator; the GEMM library is chosen for the graph's rows
(`model/gemm_library.py`), so replays pay nothing for the choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from trtdisagg.model.gemm_library import gemm_library_for

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

WARM_RUNS = 2


def capture_graph(
    forward: Callable[[], torch.Tensor],
    *,
    rows: int,
    pool: _POOL_HANDLE,
    device: torch.device,
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The graph of `forward` (a step of `rows` tokens) in memory pool `pool`, and its output
    tensor, which every replay rewrites."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with gemm_library_for(rows):
        with torch.cuda.stream(side):
            for _ in range(WARM_RUNS):
                forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
    return graph, out
