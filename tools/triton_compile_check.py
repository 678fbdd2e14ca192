"""Compile every Triton kernel variant that `CausalLM.warm_up` launches, for a GPU this machine
need not have, and print each variant's resource report.

No GPU is needed: the warm-up runs on CPU tensors with the kernels replaced by recorders, and each
recorded launch goes through Triton's own binder and compiler for the target (sm_90 by default),
the way a launch on that GPU would. For each variant: registers, spilled bytes (LOCAL), shared
memory, which matrix instructions the PTX uses (wgmma on Hopper, mma.sync otherwise), and
whether it waits for the kernel before it (`griddepcontrol.wait`: from sm_90 on, kernels launch
as dependents, `model/dependent_launch.py`, which a CPU launch never asks for). Exits non-zero
when a variant fails to compile or spills.

    python tools/triton_compile_check.py                    # the 8B geometry, sm_90
    python tools/triton_compile_check.py --kernels paged --long-rows 64 --block-n 128
    python tools/triton_compile_check.py --kernels paged --sass-dir /tmp/sass   # + SASS, PTX

A variant also fails when it needs more shared memory than an H100/H200 SM has.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch

SM_SHARED_BYTES = 227 * 1024  # what one block may use on an H100/H200 SM


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10")
    parser.add_argument("--kernels", default="", help="only kernels whose name contains this")
    parser.add_argument("--max-variants", type=int, default=0, help="stop after this many")
    parser.add_argument(
        "--sass-dir", type=Path, help="write each variant's SASS and PTX here (to read its loops)"
    )
    # tile options (unset: AttentionTiles' defaults, what serving runs)
    for option in ("--long-rows", "--block-n", "--long-warps", "--num-stages"):
        parser.add_argument(option, type=int)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter compiles nothing")

    import triton  # type: ignore[import-not-found, unused-ignore]
    from bench_decode import llama_8b_args
    from triton import knobs
    from triton.backends.compiler import GPUTarget  # type: ignore[import-not-found, unused-ignore]
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from trtdisagg.kv.cache import KVCache
    from trtdisagg.kv.page_table import Layout
    from trtdisagg.model import paged_attention, triton_ops
    from trtdisagg.model.dependent_launch import MIN_CAPABILITY
    from trtdisagg.model.llama import CausalLM

    target = GPUTarget("cuda", args.arch, 32)
    dependent = divmod(args.arch, 10) >= MIN_CAPABILITY
    backend = make_backend(target)
    launches: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    class Recorder:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: Any) -> Any:
            return lambda *a, **kw: launches.append((self.kernel, a, kw))

    for module, names in (
        (triton_ops, ("_rms_norm_kernel", "_silu_mul_kernel", "_rope_kv_kernel")),
        (paged_attention, ("_paged_attention_kernel",)),
    ):
        for name in names:
            setattr(module, name, Recorder(getattr(module, name)))

    # The 8B model's attention and widths, one layer and a small MLP and vocabulary.
    margs = attrs.evolve(llama_8b_args(), num_layers=1, intermediate_size=256, vocab_size=256)
    cpu = torch.device("cpu")
    model = CausalLM(margs, dtype=torch.bfloat16, device=cpu)
    chosen = {name: getattr(args, name) for name in ("long_rows", "block_n", "long_warps",
                                                      "num_stages")}  # fmt: skip
    tiles = paged_attention.AttentionTiles(**{k: v for k, v in chosen.items() if v is not None})
    model.use_ops(triton_ops.TritonOps(tiles))
    cache = KVCache(
        num_blocks=4, num_layers=1, num_kv_heads=margs.num_kv_heads, head_dim=margs.head_dim,
        tokens_per_block=32, layout=Layout.HND, dtype=torch.bfloat16, device=cpu,
    )  # fmt: skip
    with torch.inference_mode():
        model.warm_up(cache)

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    print(f"triton {triton.__version__}, target sm_{args.arch}, tiles {tiles}")
    seen: set[tuple[str, str, str]] = set()
    failures = dependents = 0
    for jit, call_args, call_kwargs in launches:
        name = jit.fn.__name__
        if args.kernels not in name:
            continue
        kwargs = dict(call_kwargs, debug=False)
        if "DEPENDENT" in kwargs:  # as `dependent_launch` decides on a GPU of this target
            kwargs["DEPENDENT"] = kwargs["launch_pdl"] = dependent
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        bound, specialization, options = binder(*call_args, **kwargs)
        key = (name, repr(specialization), repr(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        keys = ("NUM_SPLITS", "HAS_LONG", "HAS_RESIDUAL")
        shown = {k: v for k, v in call_kwargs.items() if k in keys}
        label = f"{name} {shown} warps={call_kwargs.get('num_warps')}"
        start = time.perf_counter()
        try:
            packed = jit._pack_args(backend, kwargs, bound, specialization, options)
            opts, signature, constexprs, attributes = packed
            compiled = triton.compile(
                ASTSource(jit, signature, constexprs, attributes),
                target=target,
                options=opts.__dict__,
            )
        except Exception as exc:  # report every variant, then fail
            failures += 1
            print(f"FAILED {label}: {exc!r}"[:2000])
            continue
        seconds = time.perf_counter() - start
        usage = "?"
        if "cubin" in compiled.asm:
            with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
                cubin.write(compiled.asm["cubin"])
                cubin.flush()
                report = subprocess.run(
                    [cuobjdump, "--dump-resource-usage", cubin.name],
                    capture_output=True,
                    text=True,
                    check=False,
                ).stdout
            usage = next((line.strip() for line in report.splitlines() if "REG:" in line), "?")
        fields = dict(part.split(":", 1) for part in usage.split() if ":" in part)
        spilled = int(fields.get("LOCAL", "0")) + int(fields.get("STACK", "0"))
        if spilled or compiled.metadata.shared > SM_SHARED_BYTES:
            failures += 1
        ptx = compiled.asm.get("ptx", "")
        if args.sass_dir is not None and "cubin" in compiled.asm:
            stem = f"{len(seen):02d}_" + re.sub(r"[^\w=-]+", "_", label).strip("_")
            _write_listings(args.sass_dir / stem, compiled.asm["cubin"], ptx, cuobjdump)
        waits = ptx.count("griddepcontrol.wait")
        dependents += bool(waits and compiled.metadata.launch_pdl)
        print(
            f"{label:70s} regs {fields.get('REG', '?'):>3s} spill {spilled} "
            f"smem {compiled.metadata.shared:6d} wgmma {ptx.count('wgmma.mma_async'):3d} "
            f"mma.sync {ptx.count('mma.sync'):3d} waits {waits} ({seconds:.1f} s)"
        )
        if args.max_variants and len(seen) >= args.max_variants:
            break
    print(f"{len(seen)} variants, {failures} failed or spilled, {dependents} launch as dependents")
    return 1 if failures or not seen else 0


def _write_listings(stem: Path, cubin: bytes, ptx: str, cuobjdump: str) -> None:
    """A variant's SASS and PTX as `stem`.sass and `stem`.ptx."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        sass = subprocess.run(
            [cuobjdump, "-sass", file.name], capture_output=True, text=True, check=True
        ).stdout
    stem.with_name(stem.name + ".sass").write_text(sass)
    stem.with_name(stem.name + ".ptx").write_text(ptx)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    raise SystemExit(main())
