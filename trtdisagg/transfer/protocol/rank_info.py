"""RankInfo: what one rank tells its peers about itself, and what two peers must share. Pure.

Each rank builds one `RankInfo` at start-up (after its KV pool and agent exist) and never changes
it. ctx rank 0 serves every rank's (INSTANCE_INFO); a gen rank sends its own (REGISTER_PEER).
Both sides' registrars (peers.py) compare `compat_fields` first: a mismatch is a
`PeerIncompatible` at registration, never deep inside a request. Attention DP splits the TP
ranks into `dp_size` groups of `tp_per_dp` consecutive ranks, each group holding every KV head.

Control endpoints come from untrusted places (a client's `ctx_info_endpoint`, a peer's RankInfo)
and zmq reads more into one than an address (`tcp://src;dst`, `*`) or raises on what it cannot
parse, so each is checked (`is_tcp_endpoint`) before zmq sees it.
"""

from __future__ import annotations

import ipaddress
import re
import uuid
from collections.abc import Mapping
from typing import Final

import attrs

from trtdisagg.kv.page_table import Layout, PageTable

_DNS_LABEL: Final = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def is_tcp_endpoint(value: str) -> bool:
    """`tcp://host:port` with an IPv4 address, a bracketed IPv6 address or a DNS name, and a
    port in [1, 65536); nothing else."""
    head, sep, port = value.rpartition(":")
    digits = port.isascii() and port.isdigit() and len(port) <= 5  # isdigit alone takes "²", "٣"
    if not (sep and head.startswith("tcp://") and digits and 0 < int(port) < 65536):
        return False
    host = head.removeprefix("tcp://")
    if host.startswith("[") and host.endswith("]"):
        return _ip_version(host[1:-1]) == 6
    if _ip_version(host) == 4:
        return True
    return len(host) <= 253 and all(_DNS_LABEL.fullmatch(label) for label in host.split("."))


def _ip_version(text: str) -> int | None:
    try:
        return ipaddress.ip_address(text).version
    except ValueError:
        return None


def flat_rank(*, tp_rank: int, pp_rank: int, tp_size: int) -> int:
    """The instance rank of (tp_rank, pp_rank): PP-major, like torch.distributed's world rank."""
    return pp_rank * tp_size + tp_rank


def layer_range(layer_num_per_pp: tuple[int, ...], pp_rank: int) -> range:
    """Global layer ids held by PP stage `pp_rank`."""
    start = sum(layer_num_per_pp[:pp_rank])
    return range(start, start + layer_num_per_pp[pp_rank])


def intersect(a: range, b: range) -> range:
    """The ids in both of two ranges of layers or heads."""
    return range(max(a.start, b.start), min(a.stop, b.stop))


def head_range(num_kv_heads: int, tp_per_dp: int, tp_in_dp: int) -> range:
    """Global KV heads held by rank `i = tp_in_dp` of a DP group of `P = tp_per_dp` ranks: with
    `K = num_kv_heads`, `[i*K/P, (i+1)*K/P)` when `K >= P`, else the head `i // (P/K)` (`P/K`
    ranks hold a copy)."""
    if num_kv_heads >= tp_per_dp:
        per_rank = num_kv_heads // tp_per_dp
        return range(tp_in_dp * per_rank, (tp_in_dp + 1) * per_rank)
    head = tp_in_dp // (tp_per_dp // num_kv_heads)
    return range(head, head + 1)


def make_instance_name(role: str) -> str:
    """A fresh instance name: rank 0 makes one per start and broadcasts it to its ranks."""
    return f"{role}-{uuid.uuid4().hex[:16]}"


@attrs.frozen(kw_only=True)
class BounceConfig:
    """Bounce-buffer settings (`cache_transceiver_config.kv_cache_bounce_size_mb`); 0 = off."""

    size_mb: int = 0
    # A pairing whose smallest direct piece is below this many bytes goes through the staging
    # buffers (`cache_transceiver_config.kv_cache_bounce_threshold_bytes`).
    threshold_bytes: int = 16384


@attrs.frozen(kw_only=True)
class RankInfo:
    """One rank's self-description; immutable for the life of the process."""

    instance_name: str  # shared by every rank of one instance start (make_instance_name)
    instance_rank: int  # flat rank, pp_rank * tp_size + tp_rank
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int = 1  # attention-DP groups; tp_size % dp_size == 0
    dp_rank: int = 0
    layer_num_per_pp: tuple[int, ...]  # layers held by each PP stage
    num_kv_heads: int  # the model's KV heads (all ranks together)
    kv_heads_per_rank: int  # heads in this rank's pool (after the TP split / duplication)
    head_dim: int
    tokens_per_block: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    element_bytes: int
    layout: Layout
    model_fingerprint: str  # hash of the model config + weights identity
    protocol_version: int  # wire.PROTOCOL_VERSION of the sender
    control_endpoint: str  # this rank's ROUTER, "tcp://host:port"
    agent_name: str  # this rank's transfer-agent name (unique per rank and start)
    agent_metadata: bytes = attrs.field(repr=False)  # TransferAgent.local_metadata()
    page_table: PageTable = attrs.field(repr=False)
    bounce: BounceConfig = BounceConfig()

    def __attrs_post_init__(self) -> None:
        if not is_tcp_endpoint(self.control_endpoint):  # peers connect to it: checked first
            raise ValueError(f"control_endpoint {self.control_endpoint!r} is not tcp://host:port")
        tp, pp, dp, layers = self.tp_size, self.pp_size, self.dp_size, self.layer_num_per_pp
        if not (0 <= self.tp_rank < tp and 0 <= self.pp_rank < pp):
            raise ValueError(f"rank (tp {self.tp_rank}, pp {self.pp_rank}) outside sizes "
                             f"(tp {tp}, pp {pp})")  # fmt: skip
        if dp <= 0 or tp % dp:
            raise ValueError(f"dp_size {dp} does not divide tp_size {tp}")
        if self.dp_rank != self.tp_rank // self.tp_per_dp:
            raise ValueError(f"dp_rank {self.dp_rank} != tp_rank {self.tp_rank} // "
                             f"{self.tp_per_dp}")  # fmt: skip
        flat = flat_rank(tp_rank=self.tp_rank, pp_rank=self.pp_rank, tp_size=tp)
        if self.instance_rank != flat:
            raise ValueError(f"instance_rank {self.instance_rank} != pp*tp+tp = {flat}")
        if len(layers) != pp or min(layers) <= 0:
            raise ValueError(f"layer_num_per_pp {layers} must hold pp_size {pp} positive counts")
        heads, per_dp = self.num_kv_heads, self.tp_per_dp
        if heads <= 0 or (heads % per_dp and per_dp % heads):
            raise ValueError(f"num_kv_heads {heads} do not split over a DP group's {per_dp} ranks")
        if self.kv_heads_per_rank != len(self.heads):
            raise ValueError(
                f"kv_heads_per_rank {self.kv_heads_per_rank} != {len(self.heads)} "
                f"({self.num_kv_heads} heads over {self.tp_per_dp} ranks)"
            )
        for group in self.page_table.layer_groups:
            if not set(group.global_layer_ids) <= set(self.layers):
                raise ValueError(f"page table layer group {group.group_id} holds layers "
                                 f"{group.global_layer_ids} outside PP stage {self.pp_rank} "
                                 f"{self.layers}")  # fmt: skip

    @property
    def key(self) -> tuple[str, int]:
        """(instance_name, instance_rank): how peers, agents and caches name this rank."""
        return (self.instance_name, self.instance_rank)

    @property
    def label(self) -> str:
        return f"{self.instance_name}#{self.instance_rank}"

    @property
    def tp_per_dp(self) -> int:
        return self.tp_size // self.dp_size

    @property
    def tp_in_dp(self) -> int:
        return self.tp_rank % self.tp_per_dp

    @property
    def layers(self) -> range:
        """Global layer ids this rank holds."""
        return layer_range(self.layer_num_per_pp, self.pp_rank)

    @property
    def heads(self) -> range:
        """Global KV head ids this rank holds."""
        return head_range(self.num_kv_heads, self.tp_per_dp, self.tp_in_dp)


def compat_fields(info: RankInfo) -> dict[str, str | int]:
    """What two instances must agree on to exchange KV, by name: checked at registration
    (peers.py), and published in a worker's `/server_info` (`kv_compat`) so that a
    coordinator can refuse a pairing before any request does. TP/PP/DP and layout (HND/NHD) may
    differ: `peers.py` maps them (or refuses a pairing)."""
    return {
        "protocol_version": info.protocol_version,
        "model_fingerprint": info.model_fingerprint,
        "dtype": info.dtype,
        "element_bytes": info.element_bytes,
        "num_kv_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
        "tokens_per_block": info.tokens_per_block,
        "num_layers": sum(info.layer_num_per_pp),
        # The bounce size shapes how KV is staged on both sides; any difference is refused.
        "kv_cache_bounce_size_mb": info.bounce.size_mb,
        "kv_cache_bounce_threshold_bytes": info.bounce.threshold_bytes,
    }


def compat_mismatches(a: Mapping[str, object], b: Mapping[str, object], *,
                      names: tuple[str, str]) -> list[str]:  # fmt: skip
    """Each field on which `a` and `b` (`compat_fields`) differ, with both values:
    `dtype: local 'float32' vs peer 'bfloat16'` for names ("local", "peer")."""
    return [
        f"{key}: {names[0]} {a.get(key)!r} vs {names[1]} {b.get(key)!r}"
        for key in dict.fromkeys([*a, *b])
        if a.get(key) != b.get(key)
    ]
