"""The `tiny` model's runner and tokenizer, loaded once per module, for tests that assemble a
real executor in process (a fresh pool over the runner's KV tensors per test)."""

from __future__ import annotations

import attrs

from trtdisagg.config import KvCacheConfig, WorkerConfig
from trtdisagg.model.loader import resolve_model
from trtdisagg.model.parallel import Parallel
from trtdisagg.worker.runner import ModelRunner, build_runner
from trtdisagg.worker.tokenization import Tokenizer


@attrs.frozen
class TinyModel:
    runner: ModelRunner
    tokenizer: Tokenizer


def load_tiny(*, tokens_per_block: int = 16, max_tokens: int = 2048) -> TinyModel:
    model_dir = resolve_model("tiny")
    config = WorkerConfig(
        max_num_tokens=256,
        kv_cache_config=KvCacheConfig(tokens_per_block=tokens_per_block, max_tokens=max_tokens),
    )
    return TinyModel(
        runner=build_runner(config, model_dir, Parallel()), tokenizer=Tokenizer.from_dir(model_dir)
    )
