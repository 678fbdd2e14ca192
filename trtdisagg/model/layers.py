"""Building blocks: Linear, Embedding, RMSNorm, the SwiGLU MLP, and the TP all-reduce.

Parameters are created with `torch.empty` at their local (already sharded) shapes: the loader
fills every one of them, so random initialisation would only cost time on large models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trtdisagg.model.parallel import Parallel

if TYPE_CHECKING:
    from trtdisagg.model.ops import TorchOps


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def all_reduce(x: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """Sum the partial results of a row-parallel layer over the TP ranks (in place)."""
    if parallel.tp_size > 1:
        dist.all_reduce(x, group=parallel.tp_group)
    return x


class Linear(nn.Module):
    """y = x W^T (+ b), W [out_features, in_features] as in Hugging Face checkpoints."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _empty(num, dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the activation dtype (HF's order of operations).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate/up column-split, down row-split over TP."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        parallel: Parallel,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        start, end = parallel.even_range(intermediate_size, what="intermediate_size")
        local = end - start
        self.gate_proj = Linear(hidden_size, local, bias=False, dtype=dtype, device=device)
        self.up_proj = Linear(hidden_size, local, bias=False, dtype=dtype, device=device)
        self.down_proj = Linear(local, hidden_size, bias=False, dtype=dtype, device=device)
        # Set by fuse(): [gate; up] in one tensor, gate/up_proj weights become views of it.
        self.gate_up_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return all_reduce(self.down_proj(h), self.parallel)

    def fuse(self) -> None:
        """One GEMM operand for gate and up (their parameters become views of it)."""
        if self.gate_up_weight is not None:
            return
        fused = torch.cat([self.gate_proj.weight, self.up_proj.weight], dim=0)
        local = self.gate_proj.weight.shape[0]
        self.gate_proj.weight = nn.Parameter(fused[:local], requires_grad=False)
        self.up_proj.weight = nn.Parameter(fused[local:], requires_grad=False)
        self.gate_up_weight = fused

    def forward_fused(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        """`forward` after `fuse()`: one gate/up GEMM, then SiLU-and-mul and the down GEMM."""
        assert self.gate_up_weight is not None, "call fuse() first"
        gate_up = ops.linear(x, self.gate_up_weight)
        return all_reduce(ops.silu_mul_linear(gate_up, self.down_proj.weight), self.parallel)
