"""Tensor- and pipeline-parallel CausalLM give the TP1 greedy tokens.

PP stages run in sequence inside one process (hidden states passed by hand); TP runs in two
spawned processes joined by gloo, so its all-reduces are real. One spawn covers every TP case.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.oracle import PagedGreedy, make_cache
from trtdisagg.kv.page_table import Layout
from trtdisagg.model.llama import CausalLM
from trtdisagg.model.loader import load_model
from trtdisagg.model.parallel import Parallel
from trtdisagg.model.tiny import TinySpec, write_checkpoint

PROMPT = [(5 * i + 11) % 250 + 7 for i in range(29)]
NEW_TOKENS = 10
CHUNKS = (7, 9)
SMALL = TinySpec(
    num_layers=4,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=96,
    tie_word_embeddings=True,  # the last PP stage then reads lm_head from the embeddings
)
SPECS = {
    "kv2": SMALL,
    # One kv head, duplicated under TP2; Qwen2's q/k/v biases are split with their rows.
    "kv1": attrs.evolve(SMALL, arch="qwen2", num_kv_heads=1, tie_word_embeddings=False),
}


def load(path: Path, parallel: Parallel) -> CausalLM:
    return load_model(path, dtype=torch.float32, device=torch.device("cpu"), parallel=parallel)


def pipeline(path: Path, *, pp_size: int, tp_rank: int = 0, tp_size: int = 1) -> PagedGreedy:
    stages = []
    for pp_rank in range(pp_size):
        parallel = Parallel(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)
        model = load(path, parallel)
        stages.append((model, make_cache(model, Layout.HND, 4, 64)))
    return PagedGreedy(stages=stages)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parallel")
    for name, spec in SPECS.items():
        write_checkpoint(spec, root / name)
    return {name: root / name for name in SPECS}


@pytest.mark.parametrize("pp_size", [2, 3])  # 3 splits 4 layers unevenly: 2 + 1 + 1
def test_pipeline_stages_match_single_stage(checkpoints: dict[str, Path], pp_size: int) -> None:
    path = checkpoints["kv2"]
    reference = pipeline(path, pp_size=1).generate(PROMPT, NEW_TOKENS, chunks=CHUNKS)
    staged = pipeline(path, pp_size=pp_size)
    assert staged.stages[0][0].local_layer_ids[0] == 0
    assert sum(m.local_num_layers for m, _ in staged.stages) == 4
    assert staged.generate(PROMPT, NEW_TOKENS, chunks=CHUNKS) == reference


def _tp_rank_main(rank: int, checkpoints: dict[str, str], out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks share two cores
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=2
    )
    results: dict[str, object] = {}
    try:
        for name, raw_path in checkpoints.items():
            path = Path(raw_path)
            tp = Parallel(tp_rank=rank, tp_size=2, tp_group=dist.group.WORLD)
            model = load(path, tp)
            driver = PagedGreedy.single(model, layout=Layout.NHD)
            results[f"{name}/tp2"] = driver.generate(PROMPT, NEW_TOKENS, chunks=CHUNKS)
            results[f"{name}/kv_heads"] = list(model.local_kv_head_ids)
            # This rank's layer-0 K must be the matching heads of the TP1 cache.
            single = PagedGreedy.single(load(path, Parallel()), layout=Layout.NHD)
            single.generate(PROMPT, NEW_TOKENS, chunks=CHUNKS)
            heads = list(model.local_kv_head_ids)
            ours = driver.stages[0][1].pool[:, 0, 0]  # [blocks, T, H_local, D]
            full = single.stages[0][1].pool[:, 0, 0, :, heads]
            results[f"{name}/k_close"] = bool(torch.allclose(ours, full, atol=1e-4))
        results["kv2/tp2pp2"] = pipeline(
            Path(checkpoints["kv2"]), pp_size=2, tp_rank=rank, tp_size=2
        ).generate(PROMPT, NEW_TOKENS, chunks=CHUNKS)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.slow
def test_tensor_parallel_matches_tp1(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    reference = {
        name: pipeline(path, pp_size=1).generate(PROMPT, NEW_TOKENS, chunks=CHUNKS)
        for name, path in checkpoints.items()
    }
    paths = {name: str(path) for name, path in checkpoints.items()}
    mp.spawn(_tp_rank_main, args=(paths, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results["kv2/tp2"] == reference["kv2"], f"rank {rank}"
        assert results["kv1/tp2"] == reference["kv1"], f"rank {rank}"
        assert results["kv2/tp2pp2"] == reference["kv2"], f"rank {rank}"
        assert results["kv2/kv_heads"] == [rank]  # two kv heads split one each
        assert results["kv1/kv_heads"] == [0]  # one kv head duplicated on both ranks
        assert results["kv2/k_close"]
        assert results["kv1/k_close"]
