"""The skinny GEMM kernel (decode-sized weight GEMMs), run by Triton's interpreter on the CPU:
every split of K, the fused SiLU-and-mul, row counts up to 16, ragged output widths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from trtdisagg.model.ops import TorchOps
from trtdisagg.model.skinny_gemm import (
    MAX_PROGRAMS,
    MAX_ROWS,
    MIN_PROGRAMS,
    GemmConfig,
    SkinnyGemms,
    _Plan,
    candidates,
    launch,
)


@pytest.mark.parametrize(
    ("rows", "n", "split_k", "silu_x"),
    [(1, 32, 1, False), (5, 48, 2, False), (16, 40, 4, False), (3, 32, 2, True), (16, 24, 1, True)],
)
def test_the_kernel_computes_x_times_w_transposed(
    rows: int, n: int, split_k: int, silu_x: bool
) -> None:
    torch.manual_seed(rows * n)
    k = 64
    x = torch.randn(rows, 2 * k if silu_x else k)
    w = torch.randn(n, k)
    plan = _Plan.allocate(GemmConfig(block_n=16, block_k=16, split_k=split_k), n, x.device)
    expected = TorchOps().silu_mul_linear(x, w) if silu_x else F.linear(x, w)
    for _ in range(2):  # the arrival counters are back at zero for the next launch
        got = launch(x, w, plan, silu_x=silu_x)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert plan.arrivals.eq(0).all()


def test_candidates_split_k_evenly_into_a_few_waves() -> None:
    found = candidates(4096, 14336)
    assert found
    for c in found:
        assert 14336 % (c.block_k * c.split_k) == 0
        assert MIN_PROGRAMS <= -(-4096 // c.block_n) * c.split_k <= MAX_PROGRAMS
    assert {c.split_k for c in candidates(28672, 4096)} == {1, 2, 4}  # 224+ programs unsplit
    assert candidates(64, 100) == []  # K splits into no candidate tile


def test_unchosen_shapes_and_large_steps_stay_on_cublas() -> None:
    gemms = SkinnyGemms()
    w = torch.randn(32, 64)
    gemms.choose(w)  # on the CPU nothing is timed, nothing chosen
    assert gemms.chosen() == {}
    assert gemms.linear(torch.randn(4, 64), w) is None
    assert gemms.linear(torch.randn(MAX_ROWS + 1, 64), w) is None


def test_a_shape_put_on_the_kernel_runs_there_up_to_16_rows() -> None:
    gemms = SkinnyGemms()
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="does not split K = 64"):
        gemms.use(w, GemmConfig(block_n=16, block_k=48, split_k=1))
    gemms.use(w, GemmConfig(block_n=16, block_k=16, split_k=2))
    x = torch.randn(MAX_ROWS, 64)
    got = gemms.linear(x, w)
    assert got is not None
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-4, atol=1e-4)
    assert gemms.linear(torch.randn(MAX_ROWS + 1, 64), w) is None  # cuBLAS's
    assert gemms.linear(x[:, :32], torch.randn(32, 32)) is None  # another shape
    assert gemms.chosen() == {(32, 64, False): GemmConfig(block_n=16, block_k=16, split_k=2)}
