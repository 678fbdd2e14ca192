"""trtdisagg: prefill/decode disaggregated LLM serving, and the same engine offline.

`from trtdisagg import LLM, SamplingParams` gives the offline engine (`trtdisagg.offline`); it is
imported on first use, so that `python -m trtdisagg coordinator` and other processes that never
run a model do not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from trtdisagg.offline import LLM, CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]

_OFFLINE = frozenset({"LLM", "CompletionOutput", "RequestOutput", "SamplingParams"})


def __getattr__(name: str) -> Any:
    if name in _OFFLINE:
        from trtdisagg import offline

        return getattr(offline, name)
    raise AttributeError(f"module 'trtdisagg' has no attribute {name!r}")
