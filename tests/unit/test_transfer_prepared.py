"""PreparedWrites: a prepared write is handed out only for its own request and source."""

from __future__ import annotations

import numpy as np

from trtdisagg.transfer.prepared import PreparedWrite, PreparedWrites
from trtdisagg.transfer.protocol.fragments import Fragments
from trtdisagg.transfer.protocol.sessions import SourceBlocks
from trtdisagg.transfer.protocol.wire import (
    NoticeTemplate,
    RequestData,
    WriteNotice,
    pack_block_ids,
)
from trtdisagg.transfer.runtime.agents.base import XferHandle

KEY = 77
SOURCE = SourceBlocks(block_ids=((1, 2, 3),), num_tokens=11)


def _request(rank: int, blocks: tuple[int, ...] = (4, 5, 6)) -> RequestData:
    return RequestData(
        key=KEY, instance_name="gen", instance_rank=rank,
        block_ids=(pack_block_ids(blocks),), num_tokens=11,
    )  # fmt: skip


def _write(rank: int, handle: int, source: SourceBlocks = SOURCE) -> PreparedWrite:
    return PreparedWrite(
        request=_request(rank), source=source, remote="gen#0",
        fragments=Fragments(np.array([[0, 0, 8]], dtype=np.int64)), handle=XferHandle(handle),
        notice=NoticeTemplate.of(WriteNotice(key=KEY, instance_name="ctx", instance_rank=0)),
    )  # fmt: skip


def test_take_hands_out_only_the_write_made_for_this_request_and_source() -> None:
    prepared = PreparedWrites()
    assert prepared.expect(KEY, [[1, 2, 3]], 11, deadline=10.0) == []
    assert prepared.source(KEY) == SOURCE
    assert prepared.add(KEY, _write(0, 1)) is None
    assert prepared.add(KEY, _write(1, 2)) is None
    assert prepared.add(KEY, _write(1, 3)) == XferHandle(2)  # replaced: release the old one
    assert len(prepared) == 2
    write, stale = prepared.take(KEY, _request(0), SOURCE)
    assert write is not None and write.handle == XferHandle(1) and stale is None
    other = SourceBlocks(block_ids=((7, 8, 9),), num_tokens=11)
    assert prepared.take(KEY, _request(1), other) == (None, XferHandle(3))  # not for this KV
    assert prepared.take(KEY, _request(1), SOURCE) == (None, None)  # gone either way
    assert len(prepared) == 0


def test_take_refuses_a_write_prepared_for_other_destination_blocks() -> None:
    prepared = PreparedWrites()
    prepared.expect(KEY, [[1, 2, 3]], 11, deadline=10.0)
    prepared.add(KEY, _write(0, 1))
    assert prepared.take(KEY, _request(0, (6, 7, 8)), SOURCE) == (None, XferHandle(1))


def test_a_new_expectation_drops_writes_made_for_the_old_one() -> None:
    prepared = PreparedWrites()
    prepared.expect(KEY, [[1, 2, 3]], 11, deadline=10.0)
    prepared.add(KEY, _write(0, 1))
    assert prepared.expect(KEY, [[1, 2, 3]], 11, deadline=20.0) == []  # same source: kept
    assert len(prepared) == 1
    assert prepared.expect(KEY, [[4, 5, 6]], 11, deadline=20.0) == [XferHandle(1)]
    assert len(prepared) == 0 and prepared.source(KEY) is not None


def test_drop_and_expiry_return_every_handle_once() -> None:
    prepared = PreparedWrites()
    prepared.expect(KEY, [[1, 2, 3]], 11, deadline=10.0)
    prepared.expect(KEY + 1, [[1, 2, 3]], 11, deadline=30.0)
    prepared.add(KEY, _write(0, 1))
    prepared.add(KEY, _write(1, 2))
    assert prepared.expired(now=9.0) == []
    assert sorted(prepared.expired(now=10.0)) == [XferHandle(1), XferHandle(2)]
    assert prepared.source(KEY) is None and prepared.source(KEY + 1) is not None
    assert prepared.drop(KEY + 1) == [] and prepared.drop(KEY) == []
