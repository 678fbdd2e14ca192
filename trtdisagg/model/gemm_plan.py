"""How each weight GEMM of a small step runs: the BLAS library, and how many rows, timed at start.

A step of a few rows reads every weight once, so a weight GEMM takes the time of the kernel the
library picks, and cuBLAS's heuristics do not always pick its fastest for the row count: some
shapes run faster at more rows than the step has (docs/BENCHMARKS.md, "Weight GEMMs of small
steps"). So, before the CUDA graphs are captured, each weight shape is timed over the model's own
weights at each small row count under each library and, where its input has spare rows, at more
rows too; a GEMM run at more rows reads the input's spare rows and its extra results are dropped.
The fused ops allocate spare rows in the inputs they produce for such GEMMs (attention's output,
SiLU-and-mul's). A choice is kept only where it beats the default (`gemm_library.library_for`,
the step's rows) by `MIN_GAIN`; replays of the graphs then pay nothing for it.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.nn.functional as F

from trtdisagg.model.gemm_library import blas_library, library_for

log = logging.getLogger(__name__)

LIBRARIES = ("cublas", "cublaslt")
MAX_TUNED_ROWS = 64  # past this a weight GEMM is no longer bound by reading the weights
RUN_ROWS = (24, 32, 64)  # row counts a GEMM whose input has spare rows may run at instead
# A choice must beat the default by this fraction, timed alone: inside a step a GEMM's neighbours
# shift its time by a few percent, and smaller gains did not show there (docs/BENCHMARKS.md,
# "Weight GEMMs of small steps").
MIN_GAIN = 0.05
TIMED_REPLAYS = 5

Shape = tuple[int, int]  # a weight's (out_features, in_features)


@attrs.frozen
class GemmChoice:
    library: str
    run_rows: int  # >= the step's rows; past them the input's spare rows, results dropped


@attrs.frozen(eq=False)
class WeightGemms:
    """One weight GEMM of each layer: its name (logs), the layers' weights (one shape), and
    whether its input is allocated with spare rows (`GemmPlan.alloc_rows`)."""

    name: str
    weights: tuple[torch.Tensor, ...]
    spare_input: bool


@attrs.frozen
class GemmPlan:
    # (rows, weight shape) -> the fastest choice, and the fastest that needs no spare rows
    best: dict[tuple[int, Shape], GemmChoice] = attrs.field(factory=dict)
    best_unpadded: dict[tuple[int, Shape], GemmChoice] = attrs.field(factory=dict)
    _alloc: dict[int, int] = attrs.field(init=False)

    @_alloc.default
    def _alloc_rows_by_rows(self) -> dict[int, int]:
        alloc: dict[int, int] = {}
        for (rows, _), choice in self.best.items():
            alloc[rows] = max(alloc.get(rows, rows), choice.run_rows)
        return alloc

    def choose(self, rows: int, shape: Shape, x: torch.Tensor) -> GemmChoice | None:
        """How to run a GEMM of `rows` rows of input `x` on a weight of `shape`; None: as torch
        would."""
        key = (rows, shape)
        best = self.best.get(key)
        if best is None or best.run_rows == rows or best.run_rows <= room(x):
            return best
        return self.best_unpadded.get(key)

    def alloc_rows(self, rows: int) -> int:
        """Rows to allocate for an input of `rows` rows that feeds a weight GEMM."""
        return self._alloc.get(rows, rows)


def room(x: torch.Tensor) -> int:
    """Rows of x's width that x's storage holds from x's first row (x row-major)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.stride(0) != x.shape[1]:
        return x.shape[0]
    elements = x.untyped_storage().nbytes() // x.element_size() - x.storage_offset()
    return elements // max(x.shape[1], 1)


def planned_linear(
    plan: GemmPlan, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x W^T (+ b) as `plan` says for x's rows and W's shape."""
    rows, width = x.shape[0], x.shape[-1]
    choice = plan.choose(rows, (weight.shape[0], weight.shape[1]), x)
    if choice is None:
        return F.linear(x, weight, bias)
    with blas_library(choice.library):
        if choice.run_rows == rows:
            return F.linear(x, weight, bias)
        wider = x.as_strided((choice.run_rows, width), (width, 1))
        return F.linear(wider, weight, bias)[:rows]


def tune(gemms: Sequence[WeightGemms], rows: Sequence[int], device: torch.device) -> GemmPlan:
    """Time every candidate of every (row count up to `MAX_TUNED_ROWS`, weight shape) on
    `device` and keep what beats the default (the module docstring). Call it in inference mode
    before capturing graphs."""
    by_shape: dict[Shape, list[WeightGemms]] = {}
    for gemm in gemms:  # GEMMs of one shape are timed once, on the first one's weights
        by_shape.setdefault((gemm.weights[0].shape[0], gemm.weights[0].shape[1]), []).append(gemm)
    best: dict[tuple[int, Shape], GemmChoice] = {}
    best_unpadded: dict[tuple[int, Shape], GemmChoice] = {}
    for shape, same in by_shape.items():
        gemm, spare = same[0], any(g.spare_input for g in same)
        for m in sorted({r for r in rows if r <= MAX_TUNED_ROWS}):
            run_rows = [m, *(r for r in RUN_ROWS if r > m)] if spare else [m]
            x = torch.randn(max(run_rows), shape[1], dtype=gemm.weights[0].dtype, device=device)
            times = {
                GemmChoice(library, r): _gemm_seconds(x[:r], gemm.weights, library, device)
                for library in LIBRARIES
                for r in run_rows
            }
            default = GemmChoice(library_for(m), m)
            unpadded = min((c for c in times if c.run_rows == m), key=times.__getitem__)
            fastest = min(times, key=times.__getitem__)
            for table, choice in ((best_unpadded, unpadded), (best, fastest)):
                if times[choice] < (1 - MIN_GAIN) * times[default]:
                    table[(m, shape)] = choice
            if (m, shape) in best:
                log.info(
                    "%s GEMM of %d rows: %s at %d rows, %.1f us against %.1f us (%s)",
                    gemm.name, m, fastest.library, fastest.run_rows, times[fastest] * 1e6,
                    times[default] * 1e6, default.library,
                )  # fmt: skip
    return GemmPlan(best=best, best_unpadded=best_unpadded)


def _gemm_seconds(
    x: torch.Tensor, weights: Sequence[torch.Tensor], library: str, device: torch.device
) -> float:
    """Seconds per GEMM of x by each weight in turn, on `library` (the weights of all layers
    together exceed the L2 cache, as in a step)."""

    def run() -> None:
        for weight in weights:
            F.linear(x, weight)

    with blas_library(library):
        return graph_seconds(run, device) / len(weights)


def graph_seconds(run: Callable[[], object], device: torch.device,
                  replays: int = TIMED_REPLAYS) -> float:  # fmt: skip
    """Median seconds of a replay of `run` captured in a CUDA graph."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()  # cuBLAS's first call on a stream may not be captured
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)
