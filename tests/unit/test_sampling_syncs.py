"""One host sync per sampled step, counted on CPU: no op whose result the host must wait for,
and one read of the chosen tokens (tests/gpu/test_gpu_sampler.py checks the same on CUDA with
torch's sync debug mode)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.sampling_reference import CPU, Row
from trtdisagg.worker.request import SamplingParams
from trtdisagg.worker.sampling import make_generator, sample

SYNCING = {
    torch.ops.aten.item,
    torch.ops.aten._local_scalar_dense,
    torch.ops.aten.is_nonzero,
    torch.ops.aten.nonzero,
    torch.ops.aten.masked_select,
    torch.ops.aten.equal,
    torch.ops.aten._unique2,
    torch.ops.aten.unique_consecutive,
    torch.ops.aten.unique_dim,
    torch.ops.aten.repeat_interleave,
}
BOOL_INDEXED = {torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_}


@attrs.define
class SyncCounter(TorchDispatchMode):
    """Counts what would make the host wait for a CUDA device: ops whose output size or value
    the host needs (`.item()`, `bool(t)`, boolean indexing, `nonzero`, ...) and reads of tensor
    contents into Python (`.tolist()`, `.numpy()` of anything but the caller's host masks)."""

    host_inputs: set[int] = attrs.Factory(set)
    syncs: list[str] = attrs.Factory(list)
    reads: list[str] = attrs.Factory(list)

    def __attrs_post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        packet = func.overloadpacket
        if packet in SYNCING or (packet in BOOL_INDEXED and _bool_index(args)):
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))

    @classmethod
    def watching(
        cls, monkeypatch: pytest.MonkeyPatch, host_inputs: Sequence[torch.Tensor]
    ) -> SyncCounter:
        counter = cls(host_inputs={id(t) for t in host_inputs})
        for name in ("tolist", "numpy"):
            original: Callable[..., Any] = getattr(torch.Tensor, name)

            def read(self: torch.Tensor, *a: Any, __o: Any = original, __n: str = name) -> Any:
                if id(self) not in counter.host_inputs:
                    counter.reads.append(__n)
                return __o(self, *a)

            monkeypatch.setattr(torch.Tensor, name, read)
        return counter


def _bool_index(args: Sequence[Any]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _every_control(width: int) -> Iterator[Row]:
    yield Row(params=SamplingParams(max_tokens=4, temperature=0.0))
    yield Row(
        params=SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, repetition_penalty=1.2),
        prompt=(1, 2),
        output=(3,),
    )
    yield Row(
        params=SamplingParams(
            max_tokens=4,
            seed=5,
            top_k=4,
            top_p=0.9,
            min_p=0.1,
            logit_bias={2: 3.0},
            presence_penalty=0.5,
            frequency_penalty=0.2,
            logprobs=0,
        ),
        suppress=frozenset({0}),
        output=(1, 1, 2),
        allowed=(-1,) * ((width + 31) // 32),
    )
    yield Row(params=SamplingParams(max_tokens=4, temperature=0.8, top_p=0.5))


def test_one_host_read_and_no_other_sync_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    specs = [r.spec() for r in _every_control(100)]
    masks = [s.allowed for s in specs if s.allowed is not None]
    counter = SyncCounter.watching(monkeypatch, masks)
    with torch.inference_mode(), counter:
        sample(logits, specs, rows=[5, 0, 2, 3], generator=make_generator(0, CPU))
    assert counter.syncs == [] and counter.reads == ["tolist"]


def test_the_sync_counter_sees_a_per_row_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: the sampler this one replaced read each row's token alone."""
    logits = torch.randn(3, 10)
    counter = SyncCounter.watching(monkeypatch, [])
    with counter:
        [int(torch.argmax(row).item()) for row in logits]
        _ = logits[logits > 0]
        logits.argmax(dim=-1).tolist()
    assert len(counter.syncs) == 4 and counter.reads == ["tolist"]
