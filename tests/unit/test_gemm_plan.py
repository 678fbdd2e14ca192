"""The weight-GEMM plan: which choice a GEMM takes, the spare rows its input needs, and that a
GEMM run at more rows than the step has gives the step's rows exactly (CPU; timing is CUDA's,
tests/gpu/test_gpu_gemm_plan.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trtdisagg.model import gemm_plan
from trtdisagg.model.gemm_plan import GemmChoice, GemmPlan, planned_linear, room

O_SHAPE = (64, 32)  # a weight (out, in)
PADDED = GemmChoice("cublas", 24)
UNPADDED = GemmChoice("cublas", 16)  # (the CPU build of torch has no cuBLASLt to switch to)


def plan() -> GemmPlan:
    return GemmPlan(
        best={(16, O_SHAPE): PADDED, (1, O_SHAPE): GemmChoice("cublas", 32)},
        best_unpadded={(16, O_SHAPE): UNPADDED},
    )


def test_a_gemm_runs_at_more_rows_only_where_its_input_has_them() -> None:
    spare = torch.empty(24, 32)[:16]
    exact = torch.empty(16, 32)
    assert plan().choose(16, O_SHAPE, spare) == PADDED
    assert plan().choose(16, O_SHAPE, exact) == UNPADDED
    assert plan().choose(1, O_SHAPE, torch.empty(1, 32)) is None  # nothing timed without spares
    assert plan().choose(8, O_SHAPE, exact[:8]) is None  # an untimed row count: torch's choice
    assert plan().choose(16, (32, 32), spare) is None  # another weight


def test_inputs_get_the_spare_rows_their_gemms_run_at() -> None:
    assert plan().alloc_rows(16) == 24
    assert plan().alloc_rows(1) == 32
    assert plan().alloc_rows(8) == 8
    assert GemmPlan().alloc_rows(16) == 16


def test_room_counts_the_rows_a_view_can_reach() -> None:
    buffer = torch.empty(32, 8)
    assert room(buffer[:16]) == 32
    assert room(buffer[4:10]) == 28
    assert room(buffer[:10, :4]) == 10  # not dense rows: only its own
    assert room(torch.empty(3, 5, 7)) == 3


def test_a_gemm_at_more_rows_gives_the_rows_of_the_step_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(O_SHAPE), torch.randn(O_SHAPE[0])
    buffer = torch.full((24, 32), float("nan"))  # what the spare rows hold is never seen
    x = buffer[:16]
    x.copy_(torch.randn(16, 32))
    rows_run: list[int] = []
    linear = F.linear

    def recording(inputs: torch.Tensor, *args: Any) -> torch.Tensor:
        rows_run.append(inputs.shape[0])
        return linear(inputs, *args)

    monkeypatch.setattr(gemm_plan.F, "linear", recording)
    out = planned_linear(plan(), x, weight, bias)
    assert rows_run == [24]
    assert out.shape == (16, O_SHAPE[0])
    torch.testing.assert_close(out, linear(x, weight, bias))
    rows_run.clear()
    exact = x.clone()  # no spare rows: the best choice at the step's rows
    torch.testing.assert_close(planned_linear(plan(), exact, weight, bias), out)
    assert rows_run == [16]
