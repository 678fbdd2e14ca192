"""Load a Hugging Face safetensors checkpoint into a CausalLM, reading only this rank's slices.

A checkpoint is `config.json` plus either `model.safetensors.index.json` (sharded: the index maps
each tensor to its file) or one or more `*.safetensors` files. Each parameter is read with
`safe_open(...).get_slice`, so a TP rank reads its rows/columns and a PP stage its layers, never
the whole tensor. Tied embeddings: when `lm_head.weight` is absent and the config ties them, the
last stage reads `model.embed_tokens.weight` instead.

Slow (file I/O, host-to-device copies): call it off the event loop.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from trtdisagg.model.args import ModelArgs, ModelLoadError
from trtdisagg.model.llama import CausalLM
from trtdisagg.model.parallel import Parallel
from trtdisagg.model.synthetic import (
    SyntheticModel,
    ensure_synthetic_dir,
    hf_shapes,
    is_synthetic,
    read_synthetic,
    synthetic_tensor,
)
from trtdisagg.model.tiny import ensure_tiny_checkpoint

INDEX_FILE = "model.safetensors.index.json"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def resolve_model(name_or_path: str, *, cache_dir: Path | None = None) -> Path:
    """ "tiny" -> the embedded default checkpoint (written on first use); "synthetic:NAME[@SEED]"
    -> a weightless synthetic model directory (`trtdisagg.model.synthetic`); else a directory
    holding config.json.

    Raises:
        ModelLoadError: the path is not a directory with a config.json.
    """
    if name_or_path == "tiny":
        return ensure_tiny_checkpoint(cache_dir)
    if is_synthetic(name_or_path):
        return ensure_synthetic_dir(name_or_path, cache_dir)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model {name_or_path!r}: not 'tiny' and not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model {name_or_path!r}: {path / 'config.json'} not found")
    return path


def load_model(
    model_dir: Path, *, dtype: torch.dtype, device: torch.device, parallel: Parallel
) -> CausalLM:
    """Build this rank's part of the model and fill every parameter from the checkpoint.

    Raises:
        ModelLoadError: missing config or safetensors file, missing tensor, a tensor of the wrong
            shape, or an unsupported architecture; the message names the file or tensor.
    """
    args = ModelArgs.from_dir(model_dir)
    try:
        model = CausalLM(args, parallel=parallel, dtype=dtype, device=device)
    except ValueError as error:  # a head/size split that this parallelism cannot do
        raise ModelLoadError(f"{model_dir}: {error}") from None
    synthetic = read_synthetic(model_dir)
    if synthetic is not None:
        _fill_synthetic(model, synthetic, args, parallel)
        return model.eval()
    tensor_files = _tensor_files(model_dir)
    first_layer = model.local_layer_ids[0] if model.local_layer_ids else 0
    with ExitStack() as stack, torch.no_grad():
        handles: dict[Path, Any] = {}
        for name, param in model.named_parameters():
            source = _global_name(name, first_layer)
            if (
                source == "lm_head.weight"
                and source not in tensor_files
                and args.tie_word_embeddings
            ):
                source = "model.embed_tokens.weight"
            file = tensor_files.get(source)
            if file is None:
                raise ModelLoadError(f"{model_dir}: tensor {source!r} not found in the checkpoint")
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            dim, start, end = _shard(name, args, parallel)
            tensor = _read(handles[file].get_slice(source), dim, start, end)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ModelLoadError(
                    f"{file.name}: tensor {source!r} slice has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)} (tp_rank {parallel.tp_rank}/{parallel.tp_size})"
                )
            param.copy_(tensor.to(device=device, dtype=dtype))
    return model.eval()


def _fill_synthetic(
    model: CausalLM, synthetic: SyntheticModel, args: ModelArgs, parallel: Parallel
) -> None:
    """Draw every parameter on the model's device; a TP rank keeps its slice of the whole."""
    shapes = hf_shapes(args)
    first_layer = model.local_layer_ids[0] if model.local_layer_ids else 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            source = _global_name(name, first_layer)
            if source == "lm_head.weight" and args.tie_word_embeddings:
                source = "model.embed_tokens.weight"
            whole = synthetic_tensor(
                synthetic, source, shapes[source], dtype=param.dtype, device=param.device
            )
            dim, start, end = _shard(name, args, parallel)
            param.copy_(_read(whole, dim, start, end))
            del whole


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the file that holds it."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = {name: model_dir / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise ModelLoadError(f"{index}: lists {file.name}, which does not exist")
        return files
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise ModelLoadError(f"{model_dir}: no *.safetensors files (and no {INDEX_FILE})")
    files = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                files[name] = path
    return files


def _global_name(local_name: str, first_layer: int) -> str:
    match = _LAYER.match(local_name)
    if match is None:
        return local_name
    layer = first_layer + int(match.group(1))
    return f"model.layers.{layer}.{local_name[match.end() :]}"


def _shard(name: str, args: ModelArgs, parallel: Parallel) -> tuple[int | None, int, int]:
    """(dim, start, end) of this rank's slice of parameter `name`; dim None = whole tensor."""
    d = args.head_dim
    if ".self_attn.q_proj." in name:
        start, end = parallel.even_range(args.num_heads, what="num_attention_heads")
        return 0, start * d, end * d
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        start, end = parallel.kv_head_range(args.num_kv_heads)
        return 0, start * d, end * d
    if name.endswith(".self_attn.o_proj.weight"):
        start, end = parallel.even_range(args.num_heads, what="num_attention_heads")
        return 1, start * d, end * d
    if name.endswith((".mlp.gate_proj.weight", ".mlp.up_proj.weight")):
        return 0, *parallel.even_range(args.intermediate_size, what="intermediate_size")
    if name.endswith(".mlp.down_proj.weight"):
        return 1, *parallel.even_range(args.intermediate_size, what="intermediate_size")
    return None, 0, 0


def _read(tensor_slice: Any, dim: int | None, start: int, end: int) -> torch.Tensor:
    if dim is None:
        return tensor_slice[:]
    if dim == 0:
        return tensor_slice[start:end]
    return tensor_slice[:, start:end]
