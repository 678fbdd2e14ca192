"""Which BLAS library a captured step's weight GEMMs use, by the step's row count.

On an H200 (bf16, Llama-3.1-8B weights), cuBLASLt reads the weights of a 32..160-row GEMM up to
6% faster than cuBLAS (4-6% at 32..96 rows), and is 2-3% slower at 1..16 rows and at 272
(`tools/bench_gemm_rows.py`, docs/BENCHMARKS.md "The engine"). The choice is made when a CUDA
graph is captured, so a replay pays nothing for it; eager steps keep torch's default. It is the
default that `gemm_plan`'s timings at start-up refine per weight shape for steps of few rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

LT_ROWS = range(32, 161)  # rows (tokens of a step) where cuBLASLt is ahead


def library_for(rows: int) -> str:
    return "cublaslt" if rows in LT_ROWS else "cublas"


@contextlib.contextmanager
def blas_library(name: str) -> Iterator[None]:
    """Prefer BLAS library `name` ("cublas" or "cublaslt") for the GEMMs launched inside."""
    before = torch.backends.cuda.preferred_blas_library()
    if str(before).rsplit(".", 1)[-1].lower() == name:  # "_BlasBackend.Cublas"
        yield
        return
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def gemm_library_for(rows: int) -> contextlib.AbstractContextManager[None]:
    """Prefer the library for `rows` while capturing a graph of that many rows."""
    return blas_library(library_for(rows))
