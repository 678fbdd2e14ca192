# mypy: disable-error-code="no-untyped-def"
"""Programmatic dependent launch for our Triton kernels (Hopper and later).

A decode step is hundreds of short kernels, and every boundary between two of them costs the
next kernel's launch while the SMs drain. Launched as a dependent (`launch_pdl`), a kernel's
programs are scheduled while the kernel before it finishes; each first waits in
`await_previous` until that kernel's writes are visible, then lets the kernel after it be
scheduled in turn. Nothing is read before the wait, so the results are those of a plain launch.
The gain: docs/BENCHMARKS.md, "Decode step".
"""

from __future__ import annotations

import functools
import os

import torch
import triton  # type: ignore[import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

MIN_CAPABILITY = (9, 0)  # griddepcontrol and the launch attribute: Hopper and later

# Triton's interpreter (CPU tensors) compiles nothing; triton_ops reads this flag too.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=16)
def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch as dependents (NVIDIA, compute capability 9.0 and up;
    never under the interpreter)."""
    if INTERPRET or device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


@triton.jit
def await_previous(DEPENDENT: tl.constexpr):
    """First thing in a kernel launched with `launch_pdl=DEPENDENT`: wait for the kernel before
    it, then allow the next one to be scheduled."""
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
