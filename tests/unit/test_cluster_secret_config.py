"""`cache_transceiver_config.cluster_secret` and `TRTDISAGG_CLUSTER_SECRET`: read, checked, and
never shown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trtdisagg.config import ConfigError, load_worker_config

FILE_SECRET = "file-secret-0123456789"
ENV_SECRET = "env-secret-9876543210"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "worker.yaml"
    path.write_text(text)
    return path


def test_the_secret_comes_from_the_file_or_the_environment(tmp_path: Path) -> None:
    assert load_worker_config(None).cache_transceiver_config.cluster_secret is None
    path = _write(
        tmp_path,
        f"cache_transceiver_config: {{backend: NIXL, cluster_secret: {FILE_SECRET}}}\n",
    )
    assert load_worker_config(path).cache_transceiver_config.cluster_secret == FILE_SECRET
    for from_env in (None, ""):  # an empty variable counts as unset
        config = load_worker_config(path, cluster_secret=from_env)
        assert config.cache_transceiver_config.cluster_secret == FILE_SECRET
    config = load_worker_config(path, cluster_secret=ENV_SECRET)
    transfer = config.cache_transceiver_config
    assert transfer.cluster_secret == ENV_SECRET  # the environment wins
    assert transfer.backend is not None and transfer.backend.value == "NIXL"  # the rest stays
    plain = load_worker_config(None, cluster_secret=ENV_SECRET)
    assert plain.cache_transceiver_config.cluster_secret == ENV_SECRET


def test_the_secret_is_in_no_repr() -> None:
    config = load_worker_config(None, cluster_secret=ENV_SECRET)
    assert ENV_SECRET not in repr(config)
    assert ENV_SECRET not in str(config.cache_transceiver_config)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("cache_transceiver_config: {cluster_secret: short-secret}\n", ["at least 16"]),
        ("cache_transceiver_config: {cluster_secret: ''}\n", ["at least 16"]),
        ("cache_transceiver_config: {cluster_secret: ' padded-secret-value '}\n", ["whitespace"]),
    ],
)
def test_a_bad_secret_names_the_key_and_not_the_value(
    tmp_path: Path, text: str, words: list[str]
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_worker_config(_write(tmp_path, text))
    message = str(caught.value)
    for word in [*words, "cache_transceiver_config.cluster_secret", "TRTDISAGG_CLUSTER_SECRET"]:
        assert word in message, message
    assert "short-secret" not in message and "padded-secret-value" not in message


def test_a_bad_secret_in_the_environment_stops_the_worker_at_start() -> None:
    value = "tiny-secret"
    env = {**os.environ, "TRTDISAGG_CLUSTER_SECRET": value}
    done = subprocess.run(
        [sys.executable, "-m", "trtdisagg", "ctx"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "cache_transceiver_config.cluster_secret" in done.stderr
    assert "TRTDISAGG_CLUSTER_SECRET" in done.stderr
    assert value not in done.stderr + done.stdout
