"""Fixtures shared by the end-to-end modules: the one cluster they may share."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.edges import Cluster
from tests.openai_cluster import openai_cluster


@pytest.fixture(scope="session")
def shared_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Cluster, httpx.Client]]:
    """A ctx and a gen worker behind a coordinator on `tiny`, in the default configuration,
    started once per session (per xdist worker) for the modules that only send it requests and
    leave it idle: a worker's start costs seconds of CPU, the suite's largest cost. Stopped at
    the end of the session."""
    with openai_cluster(tmp_path_factory.mktemp("shared_cluster")) as started:
        yield started
