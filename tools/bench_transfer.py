"""KV transfer between two real worker transceivers, against one raw NIXL write of the same bytes.

Two `spawn`ed processes (ctx and gen) each build what a worker builds (worker/transfer_setup.py):
a `KVCache` pool (CPU, or CUDA with `--device cuda`), a NIXL agent with the pool registered once,
a bound ZMQ ROUTER and a `KvTransceiver` running under `trio.run`. The parent drives them over
one pipe each, one command at a time, with bounded waits; the children are always joined (and
killed if they do not stop).

Per measured iteration, in the same run, one transfer of each selected transceiver schedule
(`--schedule`) and one raw write:

  context-first     ctx: `respond_and_send_async(key, [blocks], tokens)` (the KV is ready);
                    then gen: `request_and_receive_async(key, ctx_endpoint, [blocks], tokens)`
                    and `check_gen_transfer_status()` on every `wake` until the outcome. Timed
                    in gen, from the request call to the outcome (REQUEST_DATA, the write,
                    TRANSFER_RESULT and the WRITE_NOTICE notification all inside): what a
                    request pays when gen asks for KV that is already there.
  generation-first  what `schedule_style: generation_first` does. gen calls
                    `request_and_receive_async` FIRST and starts waiting for the outcome (a task
                    of the gen child, like the executor's wait); ctx waits until that
                    REQUEST_DATA sits in its transceiver's early buffer
                    (`statistics().early >= 1`, polled, no fixed sleep); only then does ctx's
                    KV become ready: `respond_and_send_async`, upon which ctx maps and posts
                    the write. gen is told to report the outcome before that, so no command of
                    the bench reaches gen during the transfer.
                    Timed from just before that call (a CLOCK_MONOTONIC stamp in ctx) to the
                    outcome seen in gen (the moment its wait returns): the critical path a
                    generation-first request pays once prefill ends (the write, TRANSFER_RESULT
                    and the notification; the REQUEST_DATA round trip is off it).
  raw NIXL          ctx posts ONE write (a single descriptor of the same byte count, from the
                    same source range into a contiguous destination range) on the same agents,
                    with a notification; ctx spins on the write's state (its poll that finds
                    the write done is what sends the notification) and gen on
                    `get_notifications`, each in a thread that on CUDA never sleeps
                    (`--raw-poll-us`).
                    Timed from just before the post (ctx) to the notification seen (gen).

The cross-process times (generation-first, raw) use one CLOCK_MONOTONIC on one host.

The paths of an iteration run in turn, and which one goes first rotates from one iteration to
the next. Warm-up transfers of every path come first (the first transceiver transfer pays the
connection set-up, and context-first also the rendezvous, which generation-first does before
its KV is ready; it is reported as "cold"). The destination blocks are zeroed and compared byte
for byte (a digest on both sides) after the first transfer of each path and once more per
transceiver schedule at the end.

Why the raw writes use the transceivers' own agents: they share the connection and the UCX
progress thread, so the difference between the paths is the control plane alone (a second pair
of agents would add two more busy progress threads on a small machine). The raw path touches an
agent only while its transceiver has no transfer under way, when the transceiver does not call
it (its notification pump polls only while a transfer waits), so the two never use an agent at
once and no notification of raw's is drained by the transceiver.

Printed: bytes, descriptors (from the transfer outcome), median time and GB/s (1e9 B/s) of each
path, per schedule the handover overhead (p50 of transceiver time minus raw time, per iteration:
what the control plane adds) and the stage stamps (context-first: after gen's request;
generation-first: after ctx's respond, so REQUEST_DATA's stages are negative), children's RSS
(after warm-up, at iteration 100, at the end; the growth from 100 to the end with
`--iterations >= 1000`), the CPU each child burns while measuring and while idle (the pump
polls only while a transfer waits, so idle children burn next to nothing), and last a line
`ratio_vs_raw_nixl=<transceiver GB/s / raw GB/s>` of the first selected schedule (with
`--schedule both`: context-first, preceded by `ratio_vs_raw_nixl_generation_first=<x>`).

`--ctx-busy-ms N` keeps ctx busy as a loaded ctx is: from the moment its KV is ready (and in the
raw path from just before the post), a worker thread runs ctx's "next step" for N ms, launching
small device ops from Python as a forward does, while ctx's loop goes on with the transfer. The
timed windows are unchanged; every path (raw too) runs beside it.

`--nixl-progress-thread off` creates the children's agents with `progress_thread=False` (what the
CPU launcher configs run with), so that transfers progress only when polled.
NIXL's UCX progress thread spins (about one core per idle agent), which on a 2-core machine
competes with everything else.

    python tools/bench_transfer.py                      # CPU, 64 MiB (512 tokens x 128 KiB)
    python tools/bench_transfer.py --schedule both      # context-first and generation-first
    python tools/bench_transfer.py --schedule generation-first --nixl-progress-thread off
    python tools/bench_transfer.py --scatter            # gen blocks every other slot
    python tools/bench_transfer.py --model-8b --tokens 8192 --device cuda --result-json r.json
    python tools/bench_transfer.py --iterations 1000    # RSS at iteration 100 vs the end
    python tools/bench_transfer.py --nixl-progress-thread off

Heterogeneous pairings (`--ctx-tp/--gen-tp/--ctx-pp/--gen-pp` other than 1) are refused until
workers have several ranks (issue 5).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import multiprocessing as mp
import platform
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs
import trio
from _bench_common import percentile, read_rss_kib

from trtdisagg.cpu_affinity import (
    CpuAffinityError,
    check_available,
    format_cpu_list,
    parse_cpu_list,
    pin_process,
)

if TYPE_CHECKING:
    import torch

    from trtdisagg.kv.cache import KVCache
    from trtdisagg.transfer.protocol.sessions import TransferOutcome
    from trtdisagg.transfer.runtime.agents.nixl import NixlAgent
    from trtdisagg.transfer.runtime.driver import KvTransceiver

SCHEMA: Final = "trtdisagg.bench_transfer/1"
MIB: Final = 2**20
ELEMENT_BYTES: Final = {"float16": 2, "bfloat16": 2, "float32": 4}
DEFAULT_KV_MIB: Final = 64.0
HETEROGENEOUS_REFUSAL: Final = "heterogeneous pairings need multi-rank workers (issue 5)"
RSS_CHECKPOINT: Final = 100  # RSS is sampled after this many measured iterations ...
RSS_SOAK_ITERATIONS: Final = 1000  # ... and its growth to the end is judged from this many on
SETUP_TIMEOUT_S: Final = 300.0  # a child importing torch and creating its agent on 2 busy cores
# The raw path's poll interval, both sides, by device. On CUDA raw spins: a sleep of 20 us lasts
# 55-110 us on these hosts (timer slack, a VM's timer), and made raw wait up to that long to see
# its write end on ctx (whose poll is what sends the notification), then again to see the
# notification on gen. On the 2-core CPU machine two spinning threads starve the copy itself
# (64 MiB: 23 ms spinning against 15 ms sleeping 20 us), so raw sleeps there.
RAW_POLL_S: Final = {"cuda": 0.0, "cpu": 20e-6}
RESULT_LINE: Final = "ratio_vs_raw_nixl"
IDLE_SAMPLE_S: Final = 1.0  # how long the idle children's CPU use is sampled
EARLY_POLL_S: Final = 1e-4  # ctx's poll for gen's early REQUEST_DATA (Trio rounds it to ~1 ms)
CONTEXT_FIRST: Final = "context-first"
GENERATION_FIRST: Final = "generation-first"
SCHEDULES: Final = (CONTEXT_FIRST, GENERATION_FIRST)
BOTH: Final = "both"  # --schedule both: the two schedule styles, context-first's ratio last
CHOICES: Final = {BOTH: SCHEDULES}
TIMED: Final = {  # what each schedule's time spans (the report's row names)
    CONTEXT_FIRST: "gen call->outcome",
    GENERATION_FIRST: "ctx KV ready->gen outcome",
}
STAGE_ORIGIN: Final = {  # what each schedule's stage offsets count from
    CONTEXT_FIRST: "gen.request",
    GENERATION_FIRST: "ctx.respond",  # the bench's stamp just before respond_and_send_async
}


# ---- geometry and block plan (pure) ----------------------------------------------------------


@attrs.frozen(kw_only=True)
class Geometry:
    """One rank's KV geometry (the pool is `[blocks, layers, 2, kv_heads, tokens, head_dim]`)."""

    layers: int
    kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str

    def __attrs_post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "tokens_per_block"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in ELEMENT_BYTES:
            raise ValueError(f"dtype {self.dtype!r} not one of {sorted(ELEMENT_BYTES)}")

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.element_bytes

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.tokens_per_block

    def blocks_for(self, tokens: int) -> int:
        if tokens <= 0:
            raise ValueError(f"tokens must be positive, got {tokens}")
        return -(-tokens // self.tokens_per_block)

    def transfer_bytes(self, tokens: int) -> int:
        """Bytes one homogeneous transfer moves: whole blocks (the intact mapper copies whole
        K/V entries, so a partly filled last block still moves in full)."""
        return self.blocks_for(tokens) * self.block_bytes

    def tokens_for_mib(self, kv_mib: float) -> int:
        """The longest prompt whose KV fits in `kv_mib` MiB (at least one token)."""
        if not kv_mib > 0 or not math.isfinite(kv_mib):
            raise ValueError(f"--kv-mib must be positive, got {kv_mib}")
        tokens = math.floor(kv_mib * MIB / self.bytes_per_token)
        if tokens < 1:
            raise ValueError(
                f"{kv_mib} MiB holds no token of {self.bytes_per_token} bytes; raise --kv-mib"
            )
        return tokens

    def describe(self) -> str:
        return (
            f"{self.layers} layers x {self.kv_heads} kv heads x head_dim {self.head_dim}, "
            f"{self.dtype}, {self.tokens_per_block} tokens/block, "
            f"{self.bytes_per_token / 1024:g} KiB/token"
        )


MODEL_8B: Final = Geometry(
    layers=32, kv_heads=8, head_dim=128, tokens_per_block=32, dtype="bfloat16"
)
DEFAULT_GEOMETRY: Final = MODEL_8B  # 128 KiB/token: 512 tokens are the default 64 MiB


def count_runs(src: Sequence[int], dst: Sequence[int]) -> int:
    """Descriptors of a homogeneous transfer: runs of block pairs consecutive on both sides."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    if not src:
        return 0
    return 1 + sum(
        1 for i in range(1, len(src)) if not (src[i] == src[i - 1] + 1 and dst[i] == dst[i - 1] + 1)
    )


@attrs.frozen(kw_only=True)
class BlockPlan:
    """Which blocks the request holds on each side, and the raw write's contiguous target."""

    ctx_blocks: tuple[int, ...]
    gen_blocks: tuple[int, ...]
    ctx_pool_blocks: int
    gen_pool_blocks: int
    raw_dst_first: int  # the raw write fills gen blocks [raw_dst_first, + len(ctx_blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.ctx_blocks)

    @property
    def expected_descriptors(self) -> int:
        return count_runs(self.ctx_blocks, self.gen_blocks)


def plan_blocks(num_blocks: int, *, scatter: bool) -> BlockPlan:
    """ctx holds blocks [0, n); gen gets [1, n + 1) (consecutive: one descriptor, the production
    case), or with `scatter` every other block 1, 3, 5, ... (n descriptors)."""
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    ctx = tuple(range(num_blocks))
    gen = (
        tuple(1 + 2 * i for i in range(num_blocks)) if scatter else tuple(range(1, num_blocks + 1))
    )
    return BlockPlan(
        ctx_blocks=ctx,
        gen_blocks=gen,
        ctx_pool_blocks=num_blocks,
        gen_pool_blocks=max(gen) + 1,
        raw_dst_first=1,
    )


# ---- configuration ---------------------------------------------------------------------------


def schedules_for(choice: str) -> tuple[str, ...]:
    """The transceiver schedules `--schedule <choice>` runs, the primary (last line) first."""
    if choice in CHOICES:
        return CHOICES[choice]
    if choice not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {[*SCHEDULES, *CHOICES]}, got {choice!r}")
    return (choice,)


def result_line_name(schedule: str) -> str:
    """`ratio_vs_raw_nixl_generation_first` for a schedule other than the primary one."""
    return f"{RESULT_LINE}_{schedule.replace('-', '_')}"


def _check_schedules(_: object, __: object, value: tuple[str, ...]) -> None:
    if not value or any(s not in SCHEDULES for s in value) or len(set(value)) != len(value):
        raise ValueError(f"schedules must be distinct ones of {SCHEDULES}, got {value}")


@attrs.frozen(kw_only=True)
class BenchConfig:
    geometry: Geometry
    tokens: int
    scatter: bool = False
    iterations: int = 20
    warmup: int = 3
    device: str = "cpu"
    ctx_gpu: int = 0
    gen_gpu: int | None = None  # None: GPU 1 when there are two, else 0
    timeout_s: float = 60.0
    seed: int = 0
    progress_thread: bool = True  # NIXL's UCX progress thread (production: on)
    # ctx's next step, run in a worker thread from when its KV is ready (0: ctx idles)
    ctx_busy_s: float = 0.0
    # how long raw's two polling loops sleep between polls (0: they spin)
    raw_poll_s: float = RAW_POLL_S["cpu"]
    label: str = "default"
    result_json: Path | None = None
    # the CPUs each child runs on, as a worker's `cpu_affinity` pins its engine (None: anywhere)
    ctx_cpus: tuple[int, ...] | None = None
    gen_cpus: tuple[int, ...] | None = None
    # transceiver schedules measured, each against raw; the first one's ratio is the last line
    schedules: tuple[str, ...] = attrs.field(default=(CONTEXT_FIRST,), validator=_check_schedules)

    @property
    def primary_schedule(self) -> str:
        return self.schedules[0]

    @property
    def num_bytes(self) -> int:
        return self.geometry.transfer_bytes(self.tokens)

    @property
    def blocks(self) -> BlockPlan:
        return plan_blocks(self.geometry.blocks_for(self.tokens), scatter=self.scatter)

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=True)
        out["result_json"] = None if self.result_json is None else str(self.result_json)
        out["schedules"] = list(self.schedules)
        return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_transfer.py",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    geo = parser.add_argument_group("geometry (default: 32 x 8 x 128, bfloat16, 32 tokens/block)")
    geo.add_argument("--model-8b", action="store_true", help="Llama-3.1-8B: 32 x 8 x 128, bf16")
    geo.add_argument("--layers", type=int)
    geo.add_argument("--kv-heads", type=int)
    geo.add_argument("--head-dim", type=int)
    geo.add_argument("--tokens-per-block", type=int)
    geo.add_argument("--dtype", choices=sorted(ELEMENT_BYTES))
    size = geo.add_mutually_exclusive_group()
    size.add_argument("--tokens", type=int, help="prompt length (default: what fits --kv-mib)")
    size.add_argument("--kv-mib", type=float, help=f"KV bytes to move (default {DEFAULT_KV_MIB:g})")
    parser.add_argument("--scatter", action="store_true", help="gen blocks every other slot")
    parser.add_argument("--iterations", type=int, default=20, help="measured transfers per path")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured transfers per path")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ctx-gpu", type=int, default=0, help="ctx pool's GPU (--device cuda)")
    parser.add_argument(
        "--gen-gpu", type=int, help="gen pool's GPU (--device cuda; default 1 if there are 2)"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="per transfer, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--nixl-progress-thread",
        choices=("on", "off"),
        default="on",
        help="off: the children's agents run without NIXL's progress thread, so transfers "
        "progress only when polled (the CPU launcher configs' setting)",
    )
    parser.add_argument(
        "--schedule",
        choices=(*SCHEDULES, *CHOICES),
        default=CONTEXT_FIRST,
        help="context-first: ctx's KV is ready before gen asks (timed from gen's request); "
        "generation-first: gen asks first, its REQUEST_DATA waits at ctx, then the KV becomes "
        "ready (timed from ctx's respond_and_send_async); both: each, alternating with raw "
        "(the last line stays context-first's ratio)",
    )
    parser.add_argument(
        "--ctx-busy-ms",
        type=float,
        default=0.0,
        help="ctx runs its next step (a worker thread launching small device ops) for this "
        "long from the moment its KV is ready, as a loaded ctx does; every path runs beside it",
    )
    parser.add_argument(
        "--raw-poll-us",
        type=float,
        help="the raw path: microseconds its ctx and gen threads sleep between polls; default "
        "0 on CUDA (they spin: the best a raw caller gets there) and 20 on the CPU, where "
        "spinning starves the copy",
    )
    parser.add_argument("--result-json", type=Path)
    for role in ("ctx", "gen"):
        parser.add_argument(
            f"--{role}-cpus",
            help=f'the CPUs the {role} child runs on ("1", "0-3"), as `cpu_affinity` pins a '
            "worker: its threads' wake-ups are then cheap (default: anywhere)",
        )
    pairing = parser.add_argument_group("pairing (heterogeneous: not yet, issue 5)")
    for flag in ("--ctx-tp", "--gen-tp", "--ctx-pp", "--gen-pp"):
        pairing.add_argument(flag, type=int, default=1)
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Validate parsed arguments; ValueError names what is wrong."""
    pairing = {name: getattr(args, name) for name in ("ctx_tp", "gen_tp", "ctx_pp", "gen_pp")}
    if any(v < 1 for v in pairing.values()):
        raise ValueError(f"parallel sizes must be >= 1: {pairing}")
    if any(v != 1 for v in pairing.values()):
        raise ValueError(f"{HETEROGENEOUS_REFUSAL}; got {pairing}")
    explicit = {
        "layers": args.layers,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "tokens_per_block": args.tokens_per_block,
        "dtype": args.dtype,
    }
    base = MODEL_8B if args.model_8b else DEFAULT_GEOMETRY
    if args.model_8b:
        clash = {k: v for k, v in explicit.items() if v is not None and v != getattr(MODEL_8B, k)}
        if clash:
            raise ValueError(f"--model-8b fixes the geometry; conflicting options {clash}")
    geometry = attrs.evolve(base, **{k: v for k, v in explicit.items() if v is not None})
    if args.tokens is not None:
        if args.tokens <= 0:
            raise ValueError(f"--tokens must be positive, got {args.tokens}")
        tokens = args.tokens
    else:
        tokens = geometry.tokens_for_mib(DEFAULT_KV_MIB if args.kv_mib is None else args.kv_mib)
    if args.iterations < 1 or args.warmup < 1:
        raise ValueError(
            f"--iterations and --warmup must be >= 1 (the first transfer is the cold one), "
            f"got {args.iterations} and {args.warmup}"
        )
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}")
    if not 0 <= args.ctx_busy_ms <= 10_000:
        raise ValueError(f"--ctx-busy-ms must be in [0, 10000], got {args.ctx_busy_ms}")
    if args.raw_poll_us is not None and not 0 <= args.raw_poll_us <= 10_000:
        raise ValueError(f"--raw-poll-us must be in [0, 10000], got {args.raw_poll_us}")
    if args.device == "cpu" and (args.gen_gpu is not None or args.ctx_gpu != 0):
        raise ValueError("--ctx-gpu/--gen-gpu need --device cuda")
    if min(args.ctx_gpu, 0 if args.gen_gpu is None else args.gen_gpu) < 0:
        raise ValueError("GPU indices must be >= 0")
    cpus: dict[str, tuple[int, ...] | None] = {}
    for role in ("ctx", "gen"):
        text = getattr(args, f"{role}_cpus")
        try:
            cpus[role] = None if text is None else parse_cpu_list(text)
            if text is not None:
                check_available(cpus[role] or ())
        except CpuAffinityError as exc:
            raise ValueError(f"--{role}-cpus: {exc}") from None
    label = "llama-3.1-8b" if args.model_8b else "default"
    return BenchConfig(
        ctx_cpus=cpus["ctx"],
        gen_cpus=cpus["gen"],
        geometry=geometry,
        tokens=tokens,
        scatter=args.scatter,
        iterations=args.iterations,
        warmup=args.warmup,
        device=args.device,
        ctx_gpu=args.ctx_gpu,
        gen_gpu=args.gen_gpu,
        timeout_s=args.timeout,
        seed=args.seed,
        progress_thread=args.nixl_progress_thread == "on",
        ctx_busy_s=args.ctx_busy_ms / 1000,
        raw_poll_s=(
            RAW_POLL_S[args.device] if args.raw_poll_us is None else args.raw_poll_us / 1e6
        ),
        label=label,
        result_json=args.result_json,
        schedules=schedules_for(args.schedule),
    )


def parse_config(argv: Sequence[str] | None = None) -> BenchConfig:
    """Parse and validate; a bad combination exits with status 2 and the reason (argparse)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))


# ---- statistics and report (pure) ------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PathStats:
    n: int
    median_s: float
    p10_s: float
    p90_s: float
    min_s: float
    max_s: float
    gbps: float  # bytes / median, 1e9 B/s

    @classmethod
    def of(cls, seconds: Sequence[float], num_bytes: int) -> PathStats:
        if not seconds or min(seconds) <= 0:
            raise ValueError(f"need positive times, got {list(seconds)[:5]}...")
        median = percentile(seconds, 50)
        return cls(
            n=len(seconds),
            median_s=median,
            p10_s=percentile(seconds, 10),
            p90_s=percentile(seconds, 90),
            min_s=min(seconds),
            max_s=max(seconds),
            gbps=num_bytes / median / 1e9,
        )


@attrs.frozen(kw_only=True)
class Overhead:
    """Transceiver time minus raw time of the same iteration: what the control plane adds."""

    p50_s: float
    p90_s: float
    min_s: float

    @classmethod
    def of(cls, transceiver: Sequence[float], raw: Sequence[float]) -> Overhead:
        if len(transceiver) != len(raw) or not raw:
            raise ValueError(f"{len(transceiver)} transceiver vs {len(raw)} raw times")
        diffs = [a - b for a, b in zip(transceiver, raw)]
        return cls(p50_s=percentile(diffs, 50), p90_s=percentile(diffs, 90), min_s=min(diffs))


def stage_offsets(
    stamps: Mapping[str, Sequence[Sequence[Any]]],
    keys: Sequence[int],
    origin: str = "gen.request",
) -> dict[str, dict[str, float]]:
    """Per stage (`role.stage`; `origin` first, then STAGES order): p50/p90 of its time after
    the key's `origin` stamp (gen's `request`; generation-first: `ctx.respond`, the bench's own
    stamp, so that stages before it, e.g. REQUEST_DATA's, are negative).

    Both children stamp with CLOCK_MONOTONIC (`time.monotonic`), one clock on one host. A stage
    stamped twice for a key (e.g. two notifications) counts at its first stamp.
    """
    from trtdisagg.transfer.runtime.driver import STAGES

    stages = (*STAGES, "woke", "checked")  # the last two, the bench's own: see _await_outcome

    at: dict[tuple[int, str], float] = {}
    for role, rows in stamps.items():
        for key, stage, when in rows:
            at.setdefault((int(key), f"{role}.{stage}"), float(when))
    names = [origin] + [
        name for stage in stages for role in ("gen", "ctx") if (name := f"{role}.{stage}") != origin
    ]
    out: dict[str, dict[str, float]] = {}
    for name in names:
        offsets = [
            at[(key, name)] - at[(key, origin)]
            for key in keys
            if (key, name) in at and (key, origin) in at
        ]
        if offsets:
            out[name] = {
                "p50_s": percentile(offsets, 50),
                "p90_s": percentile(offsets, 90),
                "n": len(offsets),
            }
    return out


def ratio_vs_raw(transceiver: PathStats, raw: PathStats) -> float:
    return transceiver.gbps / raw.gbps


def summarize_schedule(
    *,
    wall_s: Sequence[float],
    outcome_s: Sequence[float],
    write_s: Sequence[float],
    raw_s: Sequence[float],
    num_bytes: int,
    cold_s: float,
    stages: dict[str, dict[str, float]],
    timed: str,
) -> dict[str, Any]:
    """One transceiver schedule's part of the result doc (`doc["schedules"][name]`); its times
    are paired with the raw times of the same iterations (`raw_s`) for the overhead."""
    xcvr = PathStats.of(wall_s, num_bytes)
    return {
        "timed": timed,
        "cold_s": cold_s,
        "transceiver": attrs.asdict(xcvr),
        "transceiver_outcome": attrs.asdict(PathStats.of(outcome_s, num_bytes)),
        "transceiver_write": attrs.asdict(PathStats.of(write_s, num_bytes)),
        "handover_overhead": attrs.asdict(Overhead.of(wall_s, raw_s)),
        "stages": stages,
        "ratio_vs_raw_nixl": ratio_vs_raw(xcvr, PathStats.of(raw_s, num_bytes)),
        "samples": {
            "transceiver_s": list(wall_s),
            "transceiver_outcome_s": list(outcome_s),
            "transceiver_write_s": list(write_s),
        },
    }


def schedule_docs(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`doc["schedules"]`, primary first; a result file from before schedules existed reads as
    its one context-first schedule (top-level keys)."""
    if doc.get("schedules"):
        schedules: dict[str, dict[str, Any]] = doc["schedules"]
        return schedules
    keys = ("transceiver", "transceiver_write", "handover_overhead", "stages", "ratio_vs_raw_nixl")
    one = {k: doc.get(k) for k in keys}
    one["cold_s"] = doc["cold"]["transceiver_s"]
    one["timed"] = TIMED[CONTEXT_FIRST]
    return {CONTEXT_FIRST: one}


def rss_growth(at_checkpoint_kib: int | None, end_kib: int | None) -> float | None:
    if not at_checkpoint_kib or end_kib is None:
        return None
    return (end_kib - at_checkpoint_kib) / at_checkpoint_kib


def read_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` (every thread), from /proc/PID/stat."""
    import os

    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; field 3 is fields[0]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_share(cpu_before: float | None, cpu_after: float | None, wall_s: float) -> float | None:
    """CPU seconds per wall second over a phase (1.0 = one core busy the whole time)."""
    if cpu_before is None or cpu_after is None or wall_s <= 0:
        return None
    return (cpu_after - cpu_before) / wall_s


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f} MiB"


def _row(name: str, s: dict[str, Any]) -> str:
    return (
        f"  {name:<56}{s['median_s'] * 1e3:>9.3f} ms{s['p10_s'] * 1e3:>9.3f} ms"
        f"{s['p90_s'] * 1e3:>9.3f} ms{s['gbps']:>10.3f}"
    )


def format_report(doc: dict[str, Any]) -> str:
    """The text printed on stdout; the last line is `ratio_vs_raw_nixl=<x>` of the primary
    (first) schedule, after one `ratio_vs_raw_nixl_<schedule>=<x>` line per other schedule."""
    cfg = doc["config"]
    geo = Geometry(**cfg["geometry"])
    schedules = schedule_docs(doc)
    primary = next(iter(schedules))
    first_pays = {  # the first transceiver transfer run (primary schedule's) pays the set-up
        CONTEXT_FIRST: " (rendezvous + connection)",
        GENERATION_FIRST: " (connection; its rendezvous is before the KV is ready, untimed)",
    }
    cold = ", ".join(
        f"{name} {_ms(sd['cold_s'])}{first_pays.get(name, '') if name == primary else ''}"
        for name, sd in schedules.items()
    )
    lines = [
        f"bench_transfer [{cfg['label']}]: {geo.describe()}",
        f"  prompt {cfg['tokens']} tokens = {doc['num_blocks']} blocks; {doc['bytes']} bytes "
        f"({doc['bytes'] / MIB:.2f} MiB) per transfer; device {doc['devices']}; "
        f"{'scattered' if cfg['scatter'] else 'consecutive'} gen blocks",
        f"  descriptors: transceiver {doc['descriptors']} (expected {doc['expected_descriptors']}),"
        f" raw 1",
        f"  cold first transfer: {cold}, raw {_ms(doc['cold']['raw_s'])}",
    ]
    if cfg.get("ctx_cpus") or cfg.get("gen_cpus"):
        pinned = {r: cfg.get(f"{r}_cpus") for r in ("ctx", "gen")}
        lines.append("  pinned: " + ", ".join(
            f"{r} to CPU {format_cpu_list(c)}" for r, c in pinned.items() if c
        ))  # fmt: skip
    if cfg.get("ctx_busy_s"):
        lines.append(
            f"  ctx busy: its next step runs {cfg['ctx_busy_s'] * 1e3:g} ms in a worker thread "
            "from the moment its KV is ready (raw: from the post)"
        )
    lines += [
        f"  {'path':<56}{'median':>12}{'p10':>12}{'p90':>12}{'GB/s':>10}",
    ]
    for name, sd in schedules.items():
        lines.append(_row(f"{name} ({sd['timed']})", sd["transceiver"]))
    lines.append(_row("raw NIXL (post->notif)", doc["raw"]))
    lines.append(_row("raw initiator (post->DONE)", doc["raw_initiator"]))
    for name, sd in schedules.items():
        lines.append(_row(f"{name}: ctx write", sd["transceiver_write"]))
    for name, sd in schedules.items():
        over = sd["handover_overhead"]
        lines.append(
            f"  {name}: ratio vs raw {sd['ratio_vs_raw_nixl']:.4f}; handover overhead "
            f"(transceiver - raw, per iteration, n={sd['transceiver']['n']}): "
            f"p50 {_ms(over['p50_s'])}, p90 {_ms(over['p90_s'])}, min {_ms(over['min_s'])}"
        )
    for name, sd in schedules.items():
        stages = sd.get("stages") or {}
        origin = STAGE_ORIGIN.get(name, "gen.request")
        if stages:
            lines.append(
                f"  {name}: stages after {origin} (p50/p90 ms): "
                + ", ".join(
                    f"{stage} {s['p50_s'] * 1e3:.3f}/{s['p90_s'] * 1e3:.3f}"
                    for stage, s in stages.items()
                    if stage != origin
                )
            )
    for role in ("ctx", "gen"):
        r = doc["rss"][role]
        growth = r["growth_checkpoint_to_end"]
        grew = "" if growth is None else f" (growth {growth:+.2%})"
        lines.append(
            f"  RSS {role}: after warm-up {_mib(r['after_warmup_kib'])}, at iteration "
            f"{RSS_CHECKPOINT} {_mib(r['at_checkpoint_kib'])}, end {_mib(r['end_kib'])}{grew}"
        )
    share = doc["cpu_share"]

    def cores(role: str, phase: str) -> str:
        value = share[phase][role]
        return "-" if value is None else f"{value:.2f}"

    lines.append(
        "  CPU (cores busy): measured phase ctx "
        f"{cores('ctx', 'measured')} gen {cores('gen', 'measured')}; idle ctx "
        f"{cores('ctx', 'idle')} gen {cores('gen', 'idle')} (NIXL progress threads: "
        f"{'on' if cfg['progress_thread'] else 'off'}; raw polls "
        f"{_raw_polls(cfg.get('raw_poll_s', 20e-6))})"
    )
    stats = doc["transceiver_statistics"]
    lines.append(
        f"  sessions left: ctx senders {stats['ctx']['senders']}, gen receivers "
        f"{stats['gen']['receivers']}, ctx early {stats['ctx'].get('early', 0)}; bad frames "
        f"{stats['ctx']['bad_frames']}/{stats['gen']['bad_frames']}; bytes verified: "
        f"{doc['verified']}"
    )
    for name, sd in schedules.items():
        if name != primary:
            lines.append(f"{result_line_name(name)}={sd['ratio_vs_raw_nixl']:.4f}")
    lines.append(f"{RESULT_LINE}={schedules[primary]['ratio_vs_raw_nixl']:.4f}")
    return "\n".join(lines)


# ---- the child processes ---------------------------------------------------------------------


class ChildFailed(RuntimeError):
    """A child reported an error, died, or did not answer in time."""


class _Waker:
    """The transceiver's `wake`: sets the current event; `arm` makes a fresh one (no lost
    wake-up: arm, then check the status, then wait)."""

    def __init__(self) -> None:
        self.event = trio.Event()

    def set(self) -> None:
        self.event.set()

    def arm(self) -> trio.Event:
        self.event = trio.Event()
        return self.event


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def _device(cfg: BenchConfig, role: str) -> torch.device:
    import torch

    if cfg.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch sees no GPU")
    index = cfg.ctx_gpu
    if role == "gen":
        index = cfg.gen_gpu if cfg.gen_gpu is not None else min(1, torch.cuda.device_count() - 1)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


@attrs.define(kw_only=True)
class _PendingReceive:
    """gen, generation-first: a request already posted, whose outcome a task awaits."""

    key: int
    start: float
    done: trio.Event = attrs.Factory(trio.Event)
    seen: float = math.nan
    outcome: TransferOutcome | None = None
    error: BaseException | None = None


class _Side:
    """One child's state: its cache, agent and transceiver, and the command handlers."""

    def __init__(
        self,
        *,
        role: str,
        cfg: BenchConfig,
        conn: Connection,
        cache: KVCache,
        agent: NixlAgent,
        transceiver: KvTransceiver,
        waker: _Waker,
    ) -> None:
        self.role = role
        self.cfg = cfg
        self.conn = conn
        self.cache = cache
        self.agent = agent
        self.transceiver = transceiver
        self.waker = waker
        self.stamps: list[tuple[int, str, float]] = []  # the tracer's, and the bench's own
        self.plan = cfg.blocks
        self.outcomes: dict[int, TransferOutcome] = {}
        self.writes: list[tuple[int, int, float]] = []  # on_write: (bytes, descriptors, seconds)
        self.nursery: trio.Nursery | None = None  # set once the child's nursery is open
        self.pending: _PendingReceive | None = None
        self.busy: trio.Event | None = None  # ctx's next step (--ctx-busy-ms): set when over

    @property
    def blocks(self) -> tuple[int, ...]:
        return self.plan.ctx_blocks if self.role == "ctx" else self.plan.gen_blocks

    def _sync(self) -> None:
        if self.cache.pool.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.cache.pool.device)

    def fill_random(self) -> None:
        """ctx: random bytes in the request's blocks, once."""
        import torch

        generator = torch.Generator(device=self.cache.pool.device).manual_seed(self.cfg.seed)
        self.cache.pool.view(-1).view(torch.uint8).random_(0, 256, generator=generator)
        self._sync()

    def _ids(self, which: str) -> torch.Tensor:
        import torch

        if which == "raw":
            first = self.plan.raw_dst_first
            ids: Sequence[int] = range(first, first + self.plan.num_blocks)
        else:
            ids = self.blocks
        return torch.as_tensor(list(ids), dtype=torch.long, device=self.cache.pool.device)

    async def handle(self, cmd: str, args: dict[str, Any]) -> dict[str, Any]:
        handlers: dict[str, Callable[[dict[str, Any]], Any]] = {
            "respond": self.respond,
            "collect": self.collect,
            "receive": self.receive,
            "receive_start": self.receive_start,
            "receive_finish": self.receive_finish,
            "await_early": self.await_early,
            "raw_write": self.raw_write,
            "raw_wait": self.raw_wait,
            "clear": self.clear,
            "digest": self.digest,
            "statistics": self.statistics,
            "stages": self.stages,
        }
        handler = handlers.get(cmd)
        if handler is None:
            raise ValueError(f"{self.role}: unknown command {cmd!r}")
        result: dict[str, Any] = await handler(args)
        return result

    async def _await_outcome(
        self, key: int, check: Callable[[], list[TransferOutcome]]
    ) -> TransferOutcome:
        woke = None
        with trio.fail_after(self.cfg.timeout_s + 5):
            while True:
                event = self.waker.arm()
                for outcome in check():
                    self.outcomes[outcome.key] = outcome
                found = self.outcomes.pop(key, None)
                if found is not None:  # the check's end, and the wake-up before it
                    self.stamps.append((key, "checked", time.monotonic()))
                    if woke is not None:
                        self.stamps.append((key, "woke", woke))
                    return found
                await event.wait()  # as the executor waits: `wake` sets it
                woke = time.monotonic()

    # ctx
    async def respond(self, args: dict[str, Any]) -> dict[str, Any]:
        """The KV is ready: `respond_and_send_async`; `t0` is stamped just before the call.
        With --ctx-busy-ms, ctx's next step starts right after it, as the executor's does."""
        t0 = time.monotonic()
        self.transceiver.respond_and_send_async(args["key"], [self.blocks], self.cfg.tokens)
        self._start_busy()
        return {"t0": t0}

    def _start_busy(self) -> None:
        if not self.cfg.ctx_busy_s or self.nursery is None:
            return
        done = self.busy = trio.Event()
        device, seconds = self.cache.pool.device, self.cfg.ctx_busy_s

        async def step() -> None:
            try:
                await trio.to_thread.run_sync(_busy_step, device, seconds)
            finally:
                done.set()

        self.nursery.start_soon(step)

    async def _busy_over(self) -> None:
        if self.busy is not None:
            with trio.fail_after(self.cfg.ctx_busy_s + self.cfg.timeout_s):
                await self.busy.wait()
            self.busy = None

    async def await_early(self, args: dict[str, Any]) -> dict[str, Any]:
        """generation-first: return once gen's REQUEST_DATA waits in the early buffer."""
        start = time.monotonic()
        with trio.fail_after(self.cfg.timeout_s):
            # polled: the transceiver has no event for "a REQUEST_DATA arrived early"
            while self.transceiver.statistics().early < 1:  # noqa: ASYNC110
                await trio.sleep(EARLY_POLL_S)
        return {"waited_s": time.monotonic() - start}

    async def collect(self, args: dict[str, Any]) -> dict[str, Any]:
        outcome = await self._await_outcome(
            args["key"], self.transceiver.check_context_transfer_status
        )
        await self._busy_over()
        write = self.writes.pop() if self.writes else None
        self.writes.clear()
        return {"outcome": attrs.asdict(outcome), "write": write}

    async def raw_write(self, args: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        from trtdisagg.transfer.protocol.fragments import Fragments
        from trtdisagg.transfer.runtime.agents.base import XferStatus

        src = self.cache.pool.data_ptr()  # ctx blocks start at 0
        rows = np.array([[src, args["dst_address"], args["num_bytes"]]], dtype=np.int64)
        fragments = Fragments(rows)
        tag = args["tag"].encode()
        deadline = time.monotonic() + self.cfg.timeout_s
        poll_s = self.cfg.raw_poll_s

        def write() -> tuple[float, float]:
            start = time.monotonic()
            handle = self.agent.submit(
                fragments,
                args["remote"],
                tag,
                dst_memory_type=args["dst_memory_type"],
                dst_device_id=args["dst_device_id"],
            )
            try:
                while (state := self.agent.poll(handle)) is XferStatus.PENDING:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"raw write {args['tag']} not DONE")
                    if poll_s:
                        time.sleep(poll_s)
                done = time.monotonic()
            finally:
                self.agent.release(handle)
            if state is XferStatus.ERROR:
                raise RuntimeError(f"raw write {args['tag']} failed")
            return start, done

        self._start_busy()
        start, done = await trio.to_thread.run_sync(write)
        await self._busy_over()
        return {"start": start, "done": done}

    # gen
    async def receive(self, args: dict[str, Any]) -> dict[str, Any]:
        key = args["key"]
        start = time.monotonic()
        self.transceiver.request_and_receive_async(
            key, args["endpoint"], [self.blocks], self.cfg.tokens
        )
        outcome = await self._await_outcome(key, self.transceiver.check_gen_transfer_status)
        elapsed = time.monotonic() - start
        return {"elapsed_s": elapsed, "outcome": attrs.asdict(outcome)}

    async def receive_start(self, args: dict[str, Any]) -> dict[str, Any]:
        """generation-first: post the request and start awaiting its outcome in a task (as the
        executor does), then answer at once. The outcome is stamped when that wait returns, not
        when `receive_finish` arrives (which may be after the transfer ended)."""
        if self.nursery is None or self.pending is not None:
            raise RuntimeError("receive_start: no nursery, or a receive is already pending")
        key = args["key"]
        pending = _PendingReceive(key=key, start=time.monotonic())
        self.transceiver.request_and_receive_async(
            key, args["endpoint"], [self.blocks], self.cfg.tokens
        )
        self.pending = pending

        async def wait() -> None:
            try:
                check = self.transceiver.check_gen_transfer_status
                pending.outcome = await self._await_outcome(key, check)
                pending.seen = time.monotonic()
            except Exception as exc:  # handed to receive_finish, which raises it
                pending.error = exc
            finally:
                pending.done.set()

        self.nursery.start_soon(wait)
        return {"start": pending.start}

    async def receive_finish(self, args: dict[str, Any]) -> dict[str, Any]:
        pending, self.pending = self.pending, None
        if pending is None or pending.key != args["key"]:
            raise RuntimeError(f"receive_finish {args['key']}: no such receive pending")
        with trio.fail_after(self.cfg.timeout_s + 10):
            await pending.done.wait()
        if pending.error is not None:
            raise pending.error
        assert pending.outcome is not None
        return {
            "seen": pending.seen,
            "elapsed_s": pending.seen - pending.start,
            "outcome": attrs.asdict(pending.outcome),
        }

    async def raw_wait(self, args: dict[str, Any]) -> dict[str, Any]:
        tag = args["tag"].encode()
        deadline = time.monotonic() + self.cfg.timeout_s
        poll_s = self.cfg.raw_poll_s

        def spin() -> float:
            self.conn.send(("armed", {}))  # polling from here on: ctx may post
            while True:
                for _remote, payload in self.agent.get_notifications():
                    if payload == tag:
                        return time.monotonic()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no notification {args['tag']}")
                if poll_s:
                    time.sleep(poll_s)

        return {"seen": await trio.to_thread.run_sync(spin)}

    # both
    async def clear(self, args: dict[str, Any]) -> dict[str, Any]:
        self.cache.pool[self._ids(args["which"])] = 0
        self._sync()
        return {}

    async def digest(self, args: dict[str, Any]) -> dict[str, Any]:
        import torch

        data = self.cache.pool[self._ids(args["which"])].contiguous().view(-1).view(torch.uint8)
        if data.device.type == "cuda":
            return {"digest": _device_digest(data)}
        return {"digest": hashlib.blake2b(data.cpu().numpy().tobytes()).hexdigest()}

    async def statistics(self, args: dict[str, Any]) -> dict[str, Any]:
        return attrs.asdict(self.transceiver.statistics())

    async def stages(self, args: dict[str, Any]) -> dict[str, Any]:
        """The stage stamps since the last call (then forgotten)."""
        stamps, self.stamps = self.stamps, []
        return {"stamps": stamps}


def _raw_polls(poll_s: float) -> str:
    """How raw's loops poll (results from before the option have slept 20 us)."""
    return "spinning" if poll_s == 0 else f"every {poll_s * 1e6:g} us (sleeping)"


def _device_digest(data: torch.Tensor) -> str:
    """A position-weighted sum of the bytes as int64 words, on the GPU (mod 2**64).

    Copying 4 GiB to the host for blake2b takes seconds per check; this takes milliseconds and
    still catches any changed, moved or missing word (each position has its own odd weight).
    """
    import torch

    words = data.view(torch.int64)
    chunk = 1 << 24
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), chunk):
        part = words[start : start + chunk]
        index = torch.arange(start, start + part.numel(), dtype=torch.int64, device=data.device)
        weight = index * -7046029254386353131 + 1442695040888963407  # an LCG step: odd, spread
        total += (part * (weight | 1)).sum()
    return f"{int(total.item()) & (2**64 - 1):016x}-{words.numel()}"


async def _serve(role: str, cfg: BenchConfig, conn: Connection) -> None:
    from trtdisagg.kv.cache import KVCache
    from trtdisagg.kv.page_table import Layout
    from trtdisagg.transfer.protocol.rank_info import RankInfo, make_instance_name
    from trtdisagg.transfer.protocol.wire import PROTOCOL_VERSION
    from trtdisagg.transfer.runtime.agents.base import pool_regions
    from trtdisagg.transfer.runtime.agents.nixl import NixlAgent
    from trtdisagg.transfer.runtime.driver import KvTransceiver
    from trtdisagg.transfer.runtime.messenger import open_router

    geo, plan = cfg.geometry, cfg.blocks
    device = _device(cfg, role)
    cache = KVCache(
        num_blocks=plan.ctx_pool_blocks if role == "ctx" else plan.gen_pool_blocks,
        num_layers=geo.layers,
        num_kv_heads=geo.kv_heads,
        head_dim=geo.head_dim,
        tokens_per_block=geo.tokens_per_block,
        layout=Layout.HND,
        dtype=_torch_dtype(geo.dtype),
        device=device,
    )
    instance_name = make_instance_name(role)
    agent_name = f"{instance_name}#0"
    # NixlAgent's own switch: patching `nixl_agent_config` (as this tool once did) was overridden
    # by the explicit `enable_prog_thread=` that NixlAgent passes, so "off" still spun a core.
    agent = await trio.to_thread.run_sync(
        lambda: NixlAgent(agent_name, progress_thread=cfg.progress_thread)
    )
    try:
        page_table = cache.page_table(range(geo.layers))
        await trio.to_thread.run_sync(agent.register_memory, pool_regions(page_table))
        async with open_router("tcp://127.0.0.1:0") as router:
            info = RankInfo(
                instance_name=instance_name,
                instance_rank=0,
                tp_size=1,
                tp_rank=0,
                pp_size=1,
                pp_rank=0,
                layer_num_per_pp=(geo.layers,),
                num_kv_heads=geo.kv_heads,
                kv_heads_per_rank=geo.kv_heads,
                head_dim=geo.head_dim,
                tokens_per_block=geo.tokens_per_block,
                dtype=geo.dtype,
                element_bytes=cache.element_bytes,
                layout=cache.layout,
                model_fingerprint="bench-transfer",
                protocol_version=PROTOCOL_VERSION,
                control_endpoint=router.endpoint,
                agent_name=agent_name,
                agent_metadata=agent.local_metadata(),
                page_table=page_table,
            )
            waker = _Waker()
            side: _Side
            transceiver = KvTransceiver(
                local=info,
                instance=(info,),
                agent=agent,
                router=router,
                timeout_s=cfg.timeout_s,
                wake=waker.set,
                on_write=lambda b, d, s, _peer: side.writes.append((b, d, s)),
                tracer=lambda key, stage, at: side.stamps.append((key, stage, at)),
            )
            side = _Side(
                role=role,
                cfg=cfg,
                conn=conn,
                cache=cache,
                agent=agent,
                transceiver=transceiver,
                waker=waker,
            )
            if role == "ctx":
                side.fill_random()
            pool = page_table.layer_groups[0].pool
            async with trio.open_nursery() as nursery:
                await nursery.start(transceiver.run)
                side.nursery = nursery
                conn.send(
                    (
                        "ready",
                        {
                            "endpoint": transceiver.info_endpoint,
                            "agent_name": agent_name,
                            "pool_address": pool.base_address,
                            "memory_type": pool.memory_type,
                            "device_id": pool.device_id,
                            "device": str(device),
                        },
                    )
                )
                while True:
                    cmd, args = await _next_command(conn)
                    if cmd == "stop":
                        break
                    conn.send(("ok", await side.handle(cmd, args)))
                nursery.cancel_scope.cancel()
    finally:
        await trio.to_thread.run_sync(agent.close)


def _busy_step(device: torch.device, seconds: float) -> int:
    """ctx's next step, in a worker thread: small ops launched from Python for `seconds` (a
    forward's pattern: the interpreter lock held between launches, released inside each)."""
    import torch

    x = torch.full((64, 64), 0.01, device=device)
    steps, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        x = torch.tanh(x @ x)
        steps += sum(range(64)) > 0  # a module call's Python around each op
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return steps


async def _next_command(conn: Connection) -> tuple[str, dict[str, Any]]:
    """The parent's next command, read on the loop. Not from a worker thread: the parent sends
    its next command while a timed transfer runs, and a thread waking then takes the
    interpreter lock from the loop that is handing the transfer over (0.03-0.06 ms on the
    device). Commands are small, so one that is readable has arrived whole."""
    while not conn.poll():
        await trio.lowlevel.wait_readable(conn.fileno())
    command: tuple[str, dict[str, Any]] = conn.recv()
    return command


def child_main(role: str, cfg: BenchConfig, conn: Connection) -> None:
    """Entry point of a spawned child; every failure is reported on `conn` before exiting."""
    try:
        cpus = cfg.ctx_cpus if role == "ctx" else cfg.gen_cpus
        if cpus is not None:
            pin_process(cpus)
        trio.run(_serve, role, cfg, conn)
        conn.send(("bye", {}))
    except BaseException as exc:
        with contextlib.suppress(OSError, ValueError):
            conn.send(("error", {"error": repr(exc), "traceback": traceback.format_exc()}))
        if not isinstance(exc, (Exception, KeyboardInterrupt)):
            raise
        sys.exit(1)
    finally:
        conn.close()


# ---- the parent ------------------------------------------------------------------------------


class _Child:
    def __init__(self, context: SpawnContext, role: str, cfg: BenchConfig) -> None:
        self.role = role
        self.conn, child_conn = context.Pipe()
        self.process: BaseProcess = context.Process(
            target=child_main, args=(role, cfg, child_conn), name=f"bench-{role}", daemon=True
        )
        self.process.start()
        child_conn.close()
        self.pid = self.process.pid or 0

    def send(self, cmd: str, **args: Any) -> None:
        self.conn.send((cmd, args))

    def expect(self, kind: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.1):
            if not self.process.is_alive() and not self.conn.poll(0):
                raise ChildFailed(f"{self.role} child died (exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                raise ChildFailed(f"{self.role} child sent no {kind!r} within {timeout:g} s")
        try:
            got, payload = self.conn.recv()
        except EOFError:
            exitcode = self.process.exitcode
            raise ChildFailed(f"{self.role} child closed its pipe (exit {exitcode})") from None
        if got == "error":
            raise ChildFailed(f"{self.role} child failed:\n{payload['traceback']}")
        if got != kind:
            raise ChildFailed(f"{self.role} child sent {got!r}, expected {kind!r}")
        result: dict[str, Any] = payload
        return result

    def call(self, cmd: str, timeout: float, **args: Any) -> dict[str, Any]:
        self.send(cmd, **args)
        return self.expect("ok", timeout)

    def cpu_s(self) -> float | None:
        try:
            return read_cpu_s(self.pid)
        except (OSError, ValueError):
            return None

    def rss_kib(self) -> int | None:
        try:
            return read_rss_kib(self.pid)
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        """Ask politely, then join; kill what does not exit. Never raises."""
        try:
            if self.process.is_alive():
                self.send("stop")
                self.expect("bye", 30.0)
        except (ChildFailed, OSError, ValueError):
            pass
        self.process.join(timeout=15.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10.0)
        self.conn.close()


@attrs.frozen(kw_only=True)
class _Sample:
    """One transceiver transfer as the parent sees it."""

    key: int
    wall_s: float  # the schedule's timed span (see TIMED)
    outcome_s: float  # gen's outcome.seconds (from its request call)
    write_s: float  # ctx's write (on_write), NaN if none


@attrs.define(kw_only=True)
class _Run:
    """The parent's view of one benchmark run (both children started and ready)."""

    cfg: BenchConfig
    ctx: _Child
    gen: _Child
    ctx_ready: dict[str, Any]
    gen_ready: dict[str, Any]
    key: int = 1
    outcome_bytes: int = 0
    outcome_descriptors: int = 0
    respond_stamps: dict[int, float] = attrs.Factory(dict)  # generation-first: key -> ctx's t0

    def stamps(self) -> dict[str, list[tuple[int, str, float]]]:
        """Both transceivers' stage stamps since the last call (see `stage_offsets`), with
        ctx's `respond` stamp of each generation-first key added."""
        got = {c.role: c.call("stages", self.wait)["stamps"] for c in (self.ctx, self.gen)}
        got["ctx"] = [*got["ctx"], *((k, "respond", t) for k, t in self.respond_stamps.items())]
        self.respond_stamps = {}
        return got

    @property
    def wait(self) -> float:
        return self.cfg.timeout_s + 30.0

    def transceiver_transfer(self, schedule: str) -> _Sample:
        """One transfer through the transceivers, as `schedule` orders it."""
        key, self.key = self.key, self.key + 1
        endpoint = self.ctx_ready["endpoint"]
        if schedule == CONTEXT_FIRST:
            self.ctx.call("respond", self.wait, key=key)
            got = self.gen.call("receive", self.wait, key=key, endpoint=endpoint)
            wall = got["elapsed_s"]
        elif schedule == GENERATION_FIRST:
            # Each child answers one command at a time, so this order cannot deadlock: gen's
            # request is out (and its wait running) before ctx looks for it, and ctx has
            # responded before anyone waits for the outcome.
            self.gen.call("receive_start", self.wait, key=key, endpoint=endpoint)
            self.ctx.call("await_early", self.wait, key=key)
            # gen parks on the outcome before ctx responds: no command of ours then reaches gen
            # during the transfer (reading one wakes a thread and the loop, in the timed window;
            # the raw path's gen is likewise armed first).
            self.gen.send("receive_finish", key=key)
            t0 = self.ctx.call("respond", self.wait, key=key)["t0"]
            got = self.gen.expect("ok", self.wait)
            wall = got["seen"] - t0
            self.respond_stamps[key] = t0
        else:
            raise ValueError(f"unknown schedule {schedule!r}")
        sent = self.ctx.call("collect", self.wait, key=key)
        outcome, ctx_outcome = got["outcome"], sent["outcome"]
        if not outcome["ok"] or not ctx_outcome["ok"]:
            raise ChildFailed(f"transfer {key} failed: gen {outcome}, ctx {ctx_outcome}")
        if outcome["num_bytes"] != self.cfg.num_bytes:
            raise ChildFailed(f"transfer {key} moved {outcome['num_bytes']} bytes")
        if not wall > 0:
            raise ChildFailed(f"transfer {key} ({schedule}) timed {wall} s: clocks disagree")
        self.outcome_bytes = outcome["num_bytes"]
        self.outcome_descriptors = outcome["num_descriptors"]
        write = sent["write"]
        return _Sample(
            key=key,
            wall_s=wall,
            outcome_s=outcome["seconds"],
            write_s=write[2] if write else math.nan,
        )

    def raw_transfer(self) -> tuple[float, float]:
        """One raw write: (post -> notification seen, post -> initiator DONE)."""
        tag = f"raw-{self.key}"
        self.key += 1
        self.gen.send("raw_wait", tag=tag)
        self.gen.expect("armed", self.wait)
        wrote = self.ctx.call(
            "raw_write",
            self.wait,
            tag=tag,
            remote=self.gen_ready["agent_name"],
            dst_address=self.gen_ready["pool_address"]
            + self.cfg.blocks.raw_dst_first * self.cfg.geometry.block_bytes,
            num_bytes=self.cfg.num_bytes,
            dst_memory_type=self.gen_ready["memory_type"],
            dst_device_id=self.gen_ready["device_id"],
        )
        seen = self.gen.expect("ok", self.wait)["seen"]
        return seen - wrote["start"], wrote["done"] - wrote["start"]

    def verified(self, which: str) -> bool:
        """Whether gen's `which` blocks ("request" or "raw") hold ctx's request blocks' bytes."""
        want = self.ctx.call("digest", self.wait, which="request")["digest"]
        got = self.gen.call("digest", self.wait, which=which)["digest"]
        return bool(want == got)

    def clear(self, which: str) -> None:
        self.gen.call("clear", self.wait, which=which)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Start both children, run warm-up and measured iterations, stop them; the result doc."""
    context = mp.get_context("spawn")
    started = time.monotonic()
    children: list[_Child] = []
    schedules = cfg.schedules
    try:
        children.append(_Child(context, "ctx", cfg))
        children.append(_Child(context, "gen", cfg))
        ctx, gen = children
        ctx_ready = ctx.expect("ready", SETUP_TIMEOUT_S)
        gen_ready = gen.expect("ready", SETUP_TIMEOUT_S)
        run = _Run(cfg=cfg, ctx=ctx, gen=gen, ctx_ready=ctx_ready, gen_ready=gen_ready)
        _progress(f"children ready in {time.monotonic() - started:.1f} s; warming up")
        checks: dict[str, bool] = {}

        # cold transfers, verified byte for byte (gen blocks zeroed before each)
        cold: dict[str, float] = {}
        for schedule in schedules:
            run.clear("request")
            cold[schedule] = run.transceiver_transfer(schedule).wall_s
            checks[f"{schedule} first"] = run.verified("request")
        run.clear("raw")
        cold_raw = run.raw_transfer()[0]
        checks["raw first"] = run.verified("raw")
        for _ in range(cfg.warmup - 1):
            for schedule in schedules:
                run.transceiver_transfer(schedule)
            run.raw_transfer()

        rss: dict[str, dict[str, int | None]] = {
            c.role: {"after_warmup_kib": c.rss_kib(), "at_checkpoint_kib": None} for c in children
        }
        run.stamps()  # forget the warm-up's
        samples: dict[str, list[_Sample]] = {schedule: [] for schedule in schedules}
        cpu_before = {c.role: c.cpu_s() for c in children}
        measured_from = time.monotonic()
        raw_s: list[float] = []
        initiator_s: list[float] = []
        paths = (*schedules, "raw")
        step = max(1, cfg.iterations // 10)
        for i in range(cfg.iterations):
            turn = i % len(paths)  # who goes first rotates
            for path in paths[turn:] + paths[:turn]:
                if path == "raw":
                    seen, done = run.raw_transfer()
                    raw_s.append(seen)
                    initiator_s.append(done)
                else:
                    samples[path].append(run.transceiver_transfer(path))
            if i + 1 == RSS_CHECKPOINT:
                for c in children:
                    rss[c.role]["at_checkpoint_kib"] = c.rss_kib()
            if (i + 1) % step == 0 and cfg.iterations >= 50:
                _progress(f"  {i + 1}/{cfg.iterations} iterations")
        measured_s = time.monotonic() - measured_from
        cpu = {c.role: cpu_share(cpu_before[c.role], c.cpu_s(), measured_s) for c in children}
        stamps = run.stamps()
        stages = {
            schedule: stage_offsets(
                stamps, [x.key for x in samples[schedule]], STAGE_ORIGIN[schedule]
            )
            for schedule in schedules
        }
        for c in children:
            rss[c.role]["end_kib"] = c.rss_kib()
        # the same children idle for a while: what they burn doing nothing
        cpu_idle_before = {c.role: c.cpu_s() for c in children}
        time.sleep(IDLE_SAMPLE_S)
        cpu_idle = {
            c.role: cpu_share(cpu_idle_before[c.role], c.cpu_s(), IDLE_SAMPLE_S) for c in children
        }

        for schedule in schedules:
            run.clear("request")
            run.transceiver_transfer(schedule)
            checks[f"{schedule} last"] = run.verified("request")
        statistics = {c.role: c.call("statistics", run.wait) for c in children}
        devices = ctx_ready["device"] + " -> " + gen_ready["device"]
    finally:
        for child in children:
            child.stop()

    num_bytes = cfg.num_bytes
    schedule_doc = {
        schedule: summarize_schedule(
            wall_s=[x.wall_s for x in samples[schedule]],
            outcome_s=[x.outcome_s for x in samples[schedule]],
            write_s=[x.write_s for x in samples[schedule]],
            raw_s=raw_s,
            num_bytes=num_bytes,
            cold_s=cold[schedule],
            stages=stages[schedule],
            timed=TIMED[schedule],
        )
        for schedule in schedules
    }
    primary = schedule_doc[cfg.primary_schedule]
    rss_doc: dict[str, dict[str, Any]] = {}
    for role, r in rss.items():
        growth = None
        if cfg.iterations >= RSS_SOAK_ITERATIONS:
            growth = rss_growth(r["at_checkpoint_kib"], r["end_kib"])
        rss_doc[role] = {**r, "growth_checkpoint_to_end": growth}
    return {
        "schema": SCHEMA,
        "tool": "bench_transfer",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "config": cfg.to_json(),
        "devices": devices,
        "bytes": run.outcome_bytes,
        "num_blocks": cfg.blocks.num_blocks,
        "descriptors": run.outcome_descriptors,
        "expected_descriptors": cfg.blocks.expected_descriptors,
        # the primary (first) schedule's figures under the keys they always had
        "primary_schedule": cfg.primary_schedule,
        "cold": {"transceiver_s": primary["cold_s"], "raw_s": cold_raw},
        "transceiver": primary["transceiver"],
        "transceiver_outcome": primary["transceiver_outcome"],
        "transceiver_write": primary["transceiver_write"],
        "raw": attrs.asdict(PathStats.of(raw_s, num_bytes)),
        "raw_initiator": attrs.asdict(PathStats.of(initiator_s, num_bytes)),
        "handover_overhead": primary["handover_overhead"],
        "stages": primary["stages"],
        "ratio_vs_raw_nixl": primary["ratio_vs_raw_nixl"],
        "schedules": schedule_doc,
        "rss": rss_doc,
        "cpu_share": {"measured": cpu, "idle": cpu_idle, "measured_s": measured_s},
        "transceiver_statistics": statistics,
        "verified": all(checks.values()),
        "checks": checks,
        "samples": {
            **primary["samples"],
            "raw_s": raw_s,
            "raw_initiator_s": initiator_s,
        },
        "wall_s": time.monotonic() - started,
    }


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_config(argv)
    _progress(
        f"bench_transfer: {cfg.num_bytes} bytes, {cfg.warmup} warm-up + {cfg.iterations} "
        f"iterations per path, device {cfg.device}, schedules {', '.join(cfg.schedules)}"
    )
    try:
        doc = run_bench(cfg)
    except ChildFailed as exc:
        print(f"bench_transfer: {exc}", file=sys.stderr)
        return 1
    if cfg.result_json is not None:
        cfg.result_json.parent.mkdir(parents=True, exist_ok=True)
        cfg.result_json.write_text(json.dumps(doc, indent=1) + "\n")
    print(format_report(doc))
    if not doc["verified"]:
        print(f"bench_transfer: byte check failed: {doc['checks']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
