"""The `tiny` model's runner and tokenizer, loaded once per module, for tests that assemble a
real executor in process (a fresh pool over the runner's KV tensors per test)."""

from __future__ import annotations

import attrs

from trtdisagg.config import KvCacheConfig, WorkerConfig
from trtdisagg.metrics import WorkerMetrics
from trtdisagg.model.loader import resolve_model
from trtdisagg.model.parallel import Parallel
from trtdisagg.worker.engine.build import assemble_executor
from trtdisagg.worker.engine.executor import Executor
from trtdisagg.worker.engine.test_hooks import TestHooks
from trtdisagg.worker.engine.wakeup import Wakeup
from trtdisagg.worker.runner import ModelRunner, build_runner
from trtdisagg.worker.tokenization import Tokenizer


@attrs.frozen
class TinyModel:
    runner: ModelRunner
    tokenizer: Tokenizer

    def executor(
        self,
        config: WorkerConfig,
        *,
        wakeup: Wakeup | None = None,
        test_hooks: TestHooks | None = None,
    ) -> Executor:
        """A real executor of `config` around this runner."""
        return assemble_executor(
            config,
            runner=self.runner,
            tokenizer=self.tokenizer,
            metrics=WorkerMetrics.create(),
            wakeup=wakeup or Wakeup(),
            test_hooks=test_hooks,
        )


def load_tiny(*, tokens_per_block: int = 16, max_tokens: int = 2048) -> TinyModel:
    model_dir = resolve_model("tiny")
    config = WorkerConfig(
        max_num_tokens=256,
        kv_cache_config=KvCacheConfig(tokens_per_block=tokens_per_block, max_tokens=max_tokens),
    )
    return TinyModel(
        runner=build_runner(config, model_dir, Parallel()), tokenizer=Tokenizer.from_dir(model_dir)
    )
