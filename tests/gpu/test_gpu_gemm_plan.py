"""The weight-GEMM plan on CUDA: timing yields a usable plan, and every kind of choice (either
library, at the step's rows or more) computes the step's rows as torch does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtdisagg.model.gemm_plan import (
    MAX_TUNED_ROWS,
    GemmChoice,
    GemmPlan,
    WeightGemms,
    planned_linear,
    tune,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPE = (1024, 512)


def weights(count: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(
        torch.randn(SHAPE, dtype=torch.bfloat16, device="cuda") * 0.05 for _ in range(count)
    )


@pytest.mark.parametrize("library", ["cublas", "cublaslt"])
@pytest.mark.parametrize(("rows", "run_rows"), [(1, 1), (16, 16), (1, 24), (16, 32)])
def test_each_choice_computes_what_torch_does(library: str, rows: int, run_rows: int) -> None:
    (weight,) = weights(1)
    buffer = torch.full((run_rows, SHAPE[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    x = buffer[:rows]
    x.copy_(torch.randn(rows, SHAPE[1], dtype=torch.bfloat16, device="cuda"))
    plan = GemmPlan(best={(rows, SHAPE): GemmChoice(library, run_rows)})
    before = torch.backends.cuda.preferred_blas_library()
    out = planned_linear(plan, x, weight, None)
    assert torch.backends.cuda.preferred_blas_library() == before
    assert out.shape == (rows, SHAPE[0])
    assert torch.isfinite(out).all()  # the spare rows' NaNs stay in the dropped results
    torch.testing.assert_close(out, F.linear(x, weight), rtol=2e-2, atol=2e-2)


def test_timing_plans_only_what_it_timed() -> None:
    gemms = [
        WeightGemms("spare", weights(4), spare_input=True),
        WeightGemms("exact", tuple(w[:, :256].contiguous() for w in weights(4)), spare_input=False),
    ]
    with torch.inference_mode():
        plan = tune(gemms, rows=(1, 16, 128), device=torch.device("cuda"))
    for (rows, shape), choice in plan.best.items():
        assert rows in (1, 16) and rows <= MAX_TUNED_ROWS
        assert choice.library in ("cublas", "cublaslt")
        if shape == (SHAPE[0], 256):
            assert choice.run_rows == rows  # its input has no spare rows: never timed with them
        assert plan.alloc_rows(rows) >= choice.run_rows
    for key, choice in plan.best_unpadded.items():
        assert choice.run_rows == key[0]
