"""One small single-rank KV geometry and its RankInfo, for in-process transceiver tests.

The pools are numpy arrays registered with a (loopback) agent; the RankInfo points at them and
at a real ROUTER endpoint, as a worker's would.
"""

from __future__ import annotations

import attrs
import numpy as np

from tests.rank_infos import make_instance
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.runtime.agents.base import TransferAgent, pool_regions

NUM_SLOTS, TPB, HEADS, HEAD_DIM, LAYERS = 8, 4, 2, 8, 2


def rank_info(name: str, memory: np.ndarray, agent: TransferAgent, endpoint: str) -> RankInfo:
    """Register `memory` as the pool of instance `name` with `agent`; that rank's RankInfo."""
    (info,) = make_instance(
        instance_name=name, tp_size=1, pp_size=1, layer_num_per_pp=(LAYERS,),
        num_kv_heads=HEADS, head_dim=HEAD_DIM, tokens_per_block=TPB, num_slots=NUM_SLOTS,
        base_address=lambda rank: int(memory.ctypes.data),
    )  # fmt: skip
    agent.register_memory(pool_regions(info.page_table))
    return attrs.evolve(
        info,
        control_endpoint=endpoint,
        agent_name=agent.name,
        agent_metadata=agent.local_metadata(),
    )
