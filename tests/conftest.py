"""Session setup shared by every test directory.

Without a CUDA device, the Triton kernels can only run under Triton's interpreter, which must be
switched on before anything imports triton (transformers does, so this cannot wait for the tests
that use the kernels). Child processes inherit it; on CPU nothing else runs Triton.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
