"""Weight GEMM time of the Llama-3.1-8B shape by row count, cuBLAS against cuBLASLt.

A step of M tokens multiplies [M, K] activations by every layer's weights: qkv (6144 x 4096),
o (4096 x 4096), gate_up (28672 x 4096), down (4096 x 14336), 32 layers, bf16, random values.
Each (M, library, weight layout) is captured as one CUDA graph of all 128 GEMMs and replayed;
the median of 9 replays is printed. "row" is the worker's layout (an nn.Linear weight);
"col" is the same weight stored column-major. This is what decides whether a mixed step of M
tokens costs more than a decode step (docs/BENCHMARKS.md, "The engine").

    python tools/bench_gemm_rows.py --rows 1,16,32,64,96,128,272
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from trtdisagg.model.gemm_library import blas_library
from trtdisagg.model.gemm_plan import graph_seconds

LAYERS = 32
REPLAYS = 9  # the median of these is printed
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,32,64,96,128,272,512,2048")
    args = parser.parse_args()
    device = torch.device("cuda")
    row = {
        name: [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        for name, (n, k) in SHAPES.items()
    }
    col = {name: [w.t().contiguous().t() for w in ws] for name, ws in row.items()}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {
            name: torch.randn(m, k, device=device, dtype=torch.bfloat16)
            for name, (_, k) in SHAPES.items()
        }

        def step(weights: dict[str, list[torch.Tensor]], xs: dict[str, torch.Tensor] = xs) -> None:
            for layer in range(LAYERS):
                for name in SHAPES:
                    F.linear(xs[name], weights[name][layer])

        cells = []
        for library in ("cublas", "cublaslt"):
            for layout, weights in (("row", row), ("col", col)):
                with blas_library(library):
                    ms = 1e3 * graph_seconds(functools.partial(step, weights), device, REPLAYS)
                cells.append(f"{library}/{layout} {ms:8.3f}")
        print(f"M={m:5d} ms  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
