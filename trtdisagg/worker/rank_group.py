"""RankGroup: the torch.distributed links between the ranks of one multi-rank instance.

Three kinds of traffic, each on the group that suits it:
* control (step commands from rank 0, reports back, start-up agreement): small byte strings on
  a gloo group, so it never touches the GPU even when the model runs on NCCL;
* tensor-parallel all-reduces inside the model: the TP group of this rank's pipeline stage;
* pipeline hidden states (and the last stage's logits back to rank 0): point-to-point on the
  default group (gloo on CPU, NCCL on CUDA).

Every call here blocks: the executor runs them through `trio.to_thread.run_sync`. Every rank
makes the same collective calls in the same order; rank 0's loop is the only one that decides.
"""

from __future__ import annotations

import datetime
import logging
from typing import Final

import attrs
import torch
import torch.distributed as dist
from cattrs.preconf.msgpack import make_converter

from trtdisagg.model.parallel import Parallel
from trtdisagg.worker.rank_plan import RankReport, StepCommand

log = logging.getLogger(__name__)

# How long a collective may wait for a peer rank. An idle instance still ticks (HEARTBEAT_S), so
# only a rank stuck in a step this long times out; a dead rank's socket closes at once.
COLLECTIVE_TIMEOUT: Final = datetime.timedelta(minutes=10)
HEARTBEAT_S: Final = 5.0

_converter = make_converter(forbid_extra_keys=True)


def encode_command(command: StepCommand) -> bytes:
    data: bytes = _converter.dumps(command)
    return data


def decode_command(data: bytes) -> StepCommand:
    command: StepCommand = _converter.loads(data, StepCommand)
    return command


def encode_report(report: RankReport) -> bytes:
    data: bytes = _converter.dumps(report)
    return data


def decode_report(data: bytes) -> RankReport:
    report: RankReport = _converter.loads(data, RankReport)
    return report


@attrs.define(eq=False, kw_only=True)
class RankGroup:
    rank: int
    world_size: int
    parallel: Parallel
    control: dist.ProcessGroup | None  # None: the default group (gloo already)
    device: torch.device

    @staticmethod
    def open_store(world_size: int) -> dist.TCPStore:
        """Rank 0's rendezvous store, on a port the kernel picks as it binds: choosing a free
        port first and binding it later races with every other process starting up."""
        return dist.TCPStore(
            "127.0.0.1",
            0,
            world_size,
            is_master=True,
            timeout=COLLECTIVE_TIMEOUT,
            wait_for_workers=False,
        )

    @classmethod
    def join(
        cls,
        *,
        rank: int,
        tp_size: int,
        pp_size: int,
        port: int,
        device: torch.device,
        device_index: int = 0,
        store: dist.TCPStore | None = None,
    ) -> RankGroup:
        """Join the instance's process group (every rank calls this with its own `rank`).

        Rank 0 passes the store it opened (`open_store`); the others connect to its `port`.
        """
        world = tp_size * pp_size
        if store is None:
            store = dist.TCPStore(
                "127.0.0.1", port, world, is_master=False, timeout=COLLECTIVE_TIMEOUT
            )
        backend = "nccl" if device.type == "cuda" else "gloo"
        extra: dict[str, torch.device] = {}
        if device.type == "cuda":
            # One GPU per rank; binding the group to it makes NCCL set up on that device.
            device = torch.device("cuda", device_index)
            torch.cuda.set_device(device)
            extra["device_id"] = device
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world,
            timeout=COLLECTIVE_TIMEOUT,
            **extra,  # type: ignore[arg-type]
        )
        # new_group is collective: every rank creates every group, in the same order.
        control = dist.new_group(backend="gloo") if backend != "gloo" else None
        tp_group = None
        for stage in range(pp_size):
            members = [stage * tp_size + t for t in range(tp_size)]
            group = dist.new_group(ranks=members)
            if rank in members:
                tp_group = group
        parallel = Parallel(
            tp_rank=rank % tp_size,
            tp_size=tp_size,
            pp_rank=rank // tp_size,
            pp_size=pp_size,
            tp_group=tp_group,
            device_index=device_index,
        )
        return cls(rank=rank, world_size=world, parallel=parallel, control=control, device=device)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- control: byte strings on the gloo group ----

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0 passes `data`; every rank gets it back."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.long)
        dist.broadcast(size, src=0, group=self.control)
        if self.rank == 0:
            assert data is not None
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        if payload.numel():
            dist.broadcast(payload, src=0, group=self.control)
        return payload.numpy().tobytes()

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order, on every rank."""
        size = torch.tensor([len(data)], dtype=torch.long)
        sizes = [torch.empty(1, dtype=torch.long) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.control)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        if data:
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded, group=self.control)
        return [g[: int(s.item())].numpy().tobytes() for g, s in zip(gathered, sizes, strict=True)]

    def agree_min(self, value: int) -> int:
        """The smallest `value` over all ranks (e.g. KV blocks: every pool the same size)."""
        tensor = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor.item())

    def broadcast_command(self, command: StepCommand | None) -> StepCommand:
        return decode_command(
            self.broadcast_bytes(encode_command(command) if command is not None else None)
        )

    def gather_reports(self, report: RankReport) -> list[RankReport]:
        return [decode_report(data) for data in self.all_gather_bytes(encode_report(report))]

    # ---- pipeline: hidden states between stages, logits to rank 0 ----

    def _stage_rank(self, pp_rank: int) -> int:
        return pp_rank * self.parallel.tp_size + self.parallel.tp_rank

    def receive_hidden(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """From the same TP rank of the previous stage."""
        hidden = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(hidden, src=self._stage_rank(self.parallel.pp_rank - 1))
        return hidden

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """To the same TP rank of the next stage."""
        dist.send(hidden.contiguous(), dst=self._stage_rank(self.parallel.pp_rank + 1))

    @property
    def logits_source(self) -> int:
        """The rank whose logits rank 0 samples from: TP rank 0 of the last stage."""
        return (self.parallel.pp_size - 1) * self.parallel.tp_size

    def send_logits(self, logits: torch.Tensor) -> None:
        dist.send(logits.contiguous(), dst=0)

    def receive_logits(self, shape: tuple[int, ...]) -> torch.Tensor:
        logits = torch.empty(shape, dtype=torch.float32, device=self.device)
        dist.recv(logits, src=self.logits_source)
        return logits
