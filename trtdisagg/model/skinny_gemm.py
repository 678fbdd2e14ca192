# mypy: disable-error-code="no-untyped-def"
"""Weight GEMMs of decode-sized steps (at most 16 rows) as one Triton kernel, for each weight
shape where it beats cuBLAS on this GPU, timed once at start-up.

A decode step reads every weight once for a handful of rows, so its GEMMs are a race to stream
the weights from HBM. The kernel computes y^T = W x^T: a program takes `block_n` output features
of every row (the weight tile is the MMA's large side, the 16 rows its small one) over a slice of
K; with `split_k` slices, each stores its float32 partial sum and the program that arrives last
adds them up in slice order and rounds once, so no second launch is needed. For the MLP's down
projection the kernel reads the gate/up GEMM's output and applies SiLU-and-mul as it loads it,
with the rounding of the separate kernel (`TritonOps.silu_mul`), which then does not run.

`SkinnyGemms.choose` times the candidate configurations of a weight shape against cuBLAS (with
L2 flushed before each run, so the weights come from HBM as in a step) and keeps the fastest if
it beats cuBLAS by `MIN_GAIN`; CUDA only. The kernel's row count is kept out of Triton's
specialisation key, so one compiled variant serves 1..16 rows.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Final

import attrs
import torch
import torch.nn.functional as F
import triton  # type: ignore[import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

MAX_ROWS: Final = 16  # rows the kernel takes (one MMA's small side)
MIN_GAIN: Final = 0.02  # a shape keeps cuBLAS unless the kernel is this much faster
# Program counts worth trying: at least one wave of a 132-SM GPU, at most a few.
MIN_PROGRAMS, MAX_PROGRAMS = 100, 1100
MAX_SHARED_BYTES: Final = 200 * 1024  # of an SM's shared memory (H100/H200: 227 KiB)


@triton.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["x_ptr"])
def _skinny_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    part_ptr,
    arrivals_ptr,
    M,
    N,
    K,
    x_row,
    w_row,
    y_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SILU_X: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    per_split = K // SPLIT_K
    k0 = split * per_split
    n_ok = n < N
    m_ok = m[None, :] < M
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * w_row + (k0 + k)[None, :]
    x_ptrs = x_ptr + m[None, :] * x_row + (k0 + k)[:, None]  # x^T: [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for _ in range(0, per_split, BLOCK_K):
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        if SILU_X:  # x is [gate | up], K wide each: silu(gate) * up, rounded as silu_mul does
            gate = tl.load(x_ptrs, mask=m_ok, other=0.0)
            up = tl.load(x_ptrs + K, mask=m_ok, other=0.0)
            g32 = gate.to(tl.float32)
            silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
            x = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        else:
            x = tl.load(x_ptrs, mask=m_ok, other=0.0)
        acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y_ptrs = y_ptr + m[None, :] * y_row + n[:, None]
    y_ok = m_ok & n_ok[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_ok)
    else:
        parts = part_ptr + (n[:, None] * SPLIT_K) * BLOCK_M + m[None, :]
        tl.store(parts + split * BLOCK_M, acc, mask=n_ok[:, None])
        # Every thread's partial stores come before the arrival, which releases them to the
        # program that arrives last (CUTLASS's split-K semaphore).
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:
            tl.store(arrivals_ptr + pid_n, 0)  # ready for the next launch
            total = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for s in range(SPLIT_K):  # in slice order: the same sum on every run
                total += tl.load(parts + s * BLOCK_M, mask=n_ok[:, None], other=0.0)
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_ok)


KERNEL: Final = _skinny_kernel
L2_FLUSH_BYTES: Final = 256 << 20  # written before each timed run: more than any GPU's L2
TIMED_RUNS: Final = 20


def _median_ms(fn: Callable[[], object], flush: torch.Tensor) -> float:
    """Median CUDA time of `fn` over TIMED_RUNS runs (after 3 untimed), each from a cold L2."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(TIMED_RUNS):
        flush.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[TIMED_RUNS // 2]


@attrs.frozen
class GemmConfig:
    block_n: int
    block_k: int
    split_k: int
    warps: int = 4
    stages: int = 3


def candidates(n: int, k: int) -> list[GemmConfig]:
    """Configurations worth timing for an [n, k] weight: K splits evenly, and the launch has
    between one and a few waves of programs."""
    found = []
    for block_n, block_k, split_k, stages in itertools.product(
        (64, 128), (128, 256), (1, 2, 4, 8), (3, 4)
    ):
        programs = triton.cdiv(n, block_n) * split_k
        # each pipeline stage holds a weight tile and up to two 16-row x tiles, in bf16
        shared = stages * (block_n + 2 * MAX_ROWS) * block_k * 2
        if (k % (block_k * split_k) == 0 and MIN_PROGRAMS <= programs <= MAX_PROGRAMS
                and shared <= MAX_SHARED_BYTES):  # fmt: skip
            found.append(GemmConfig(block_n, block_k, split_k, stages=stages))
    return found


@attrs.define(eq=False)
class _Plan:
    """A weight shape's chosen configuration and its buffers (kept: graphs launch on them)."""

    config: GemmConfig
    partials: torch.Tensor  # float32 [N, split_k, MAX_ROWS]
    arrivals: torch.Tensor  # int32 [programs along N], zero between launches
    spilled: bool = False  # its compiled variant spills registers (seen at a launch)

    @classmethod
    def allocate(cls, config: GemmConfig, n: int, device: torch.device) -> _Plan:
        return cls(
            config=config,
            partials=torch.empty(n * config.split_k * MAX_ROWS, device=device, dtype=torch.float32),
            arrivals=torch.zeros(triton.cdiv(n, config.block_n), device=device, dtype=torch.int32),
        )


def launch(x: torch.Tensor, weight: torch.Tensor, plan: _Plan, *, silu_x: bool) -> torch.Tensor:
    """y = x W^T (x: [rows <= 16, K], or [rows, 2K] of gate/up with `silu_x`)."""
    rows = x.shape[0]
    n, k = weight.shape
    assert rows <= MAX_ROWS and x.stride(1) == 1 and weight.stride(1) == 1
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    c = plan.config
    compiled = _skinny_kernel[(triton.cdiv(n, c.block_n), c.split_k)](
        x, weight, y, plan.partials, plan.arrivals, rows, n, k, x.stride(0), weight.stride(0),
        y.stride(0), BLOCK_M=MAX_ROWS, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=c.split_k,
        SILU_X=silu_x, num_warps=c.warps, num_stages=c.stages,
    )  # fmt: skip
    plan.spilled = plan.spilled or getattr(compiled, "n_spills", 0) > 0  # (none interpreted)
    return y


class SkinnyGemms:
    """Which weight shapes use the kernel, and with what (chosen by `choose`)."""

    def __init__(self) -> None:
        # (n, k, silu_x, device) -> the plan, or None: cuBLAS is as fast
        self._plans: dict[tuple[int, int, bool, torch.device], _Plan | None] = {}
        self._in_use = False  # some shape has a plan (else `linear` looks nothing up)
        # (n, k, silu_x) -> (cuBLAS ms, the fastest configuration's ms), as `choose` timed them
        self.timings: dict[tuple[int, int, bool], tuple[float, float]] = {}

    def linear(self, x: torch.Tensor, weight: torch.Tensor, *, silu_x: bool = False):
        """x W^T through the kernel where it was chosen for this shape, else None."""
        if not self._in_use or x.shape[0] > MAX_ROWS or x.stride(1) != 1:
            return None
        plan = self._plans.get((*weight.shape, silu_x, weight.device))
        return None if plan is None else launch(x, weight, plan, silu_x=silu_x)

    def use(self, weight: torch.Tensor, config: GemmConfig, *, silu_x: bool = False) -> None:
        """Run this weight shape through the kernel with `config`, untimed (a tool's or a
        test's choice; `choose` keeps it)."""
        n, k = weight.shape
        if k % (config.block_k * config.split_k):
            raise ValueError(f"{config} does not split K = {k} evenly")
        self._plans[(n, k, silu_x, weight.device)] = _Plan.allocate(config, n, weight.device)
        self._in_use = True

    def chosen(self) -> dict[tuple[int, int, bool], GemmConfig | None]:
        return {key[:3]: None if p is None else p.config for key, p in self._plans.items()}

    def choose(
        self,
        weight: torch.Tensor,
        *,
        silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Time the candidates for this weight's shape against cuBLAS at 16 rows (after
        `silu_mul`, when given: the down projection), and keep the fastest if it wins by
        `MIN_GAIN`. CUDA only; once per shape."""
        n, k = weight.shape
        silu_x = silu_mul is not None
        key = (n, k, silu_x, weight.device)
        if weight.device.type != "cuda" or key in self._plans or weight.stride(1) != 1:
            return
        from triton.runtime.errors import OutOfResources  # type: ignore[import-not-found, unused-ignore]

        x = torch.randn(MAX_ROWS, 2 * k if silu_x else k, device=weight.device, dtype=weight.dtype)
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=weight.device)
        cublas_ms = _median_ms(lambda: F.linear(silu_mul(x) if silu_mul else x, weight), flush)
        timed = []
        for config in candidates(n, k):
            plan = _Plan.allocate(config, n, weight.device)
            run = functools.partial(launch, x, weight, plan, silu_x=silu_x)
            try:
                ms = _median_ms(run, flush)
            except OutOfResources:  # a GPU with less shared memory than the candidates assume
                continue
            if not plan.spilled:  # (a variant that spills registers is slow, or soon will be)
                timed.append((ms, plan))
        best_ms, best = min(timed, key=lambda t: t[0], default=(cublas_ms, None))
        self._plans[key] = best if best_ms < cublas_ms * (1 - MIN_GAIN) else None
        self._in_use = self._in_use or self._plans[key] is not None
        self.timings[key[:3]] = (cublas_ms, best_ms)
