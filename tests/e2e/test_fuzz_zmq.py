"""Control-plane fuzzing of a real ctx and gen: random frames at each worker's ZMQ ROUTER.

Every frame set that is not one well-formed message of this protocol (a wrong frame count, bytes
that are not msgpack, msgpack of the wrong shape, a known tag with missing, extra or mistyped
fields, a RankInfo whose numbers contradict each other) is counted exactly once in
`trtdisagg_control_bad_frames_total` and dropped. Well-formed messages that make no sense here
(results for unknown transfers, data requests from ranks that never registered) are ignored. A
registration with another protocol version, another dtype or agent metadata NIXL cannot load is
refused with a reason. Through all of it the listeners stay up, and a real ctx → gen transfer
still moves the right KV afterwards. (tests/e2e/test_disagg_transfer.py has the plain
garbage-frames case; this file covers the rest.)
"""

from __future__ import annotations

import contextlib
import string
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.edges import (
    TRANSFER_TIMEOUT_MS,
    Cluster,
    aggregated,
    completion,
    info_endpoint,
    metrics_of,
    running_cluster,
    split,
    wait_idle,
    wait_until,
)
from tests.procs import metric
from trtdisagg.transfer.errors import ProtocolError
from trtdisagg.transfer.protocol.rank_info import RankInfo
from trtdisagg.transfer.protocol.wire import (
    MESSAGE_TAGS,
    PROTOCOL_VERSION,
    Cancel,
    InstanceInfo,
    Message,
    RegisterAck,
    RegisterPeer,
    RequestData,
    RequestInstanceInfo,
    ResultStatus,
    TransferResult,
    WriteNotice,
    decode,
    encode,
    pack_block_ids,
)

pytestmark = pytest.mark.timeout(240)

BAD_FRAMES = "trtdisagg_control_bad_frames_total"
REPLY_TIMEOUT_MS = 10_000
FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("fuzz_zmq")
    with running_cluster(tmp, with_coordinator=False) as running:
        with httpx.Client(timeout=60, trust_env=False) as client:
            split(client, running, completion([1, 2, 3, 4], 2))  # gen registered with ctx first
        yield running


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60, trust_env=False) as http:
        yield http


@contextlib.contextmanager
def dealer(endpoint: str) -> Iterator[zmq.Socket[bytes]]:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.RCVTIMEO, REPLY_TIMEOUT_MS)
    socket.connect(endpoint)
    try:
        yield socket
    finally:
        socket.close(linger=5000)  # connect is asynchronous: let queued frames go out first


def request(socket: zmq.Socket[bytes], message: Message) -> Message:
    socket.send(encode(message))
    return decode(socket.recv())


def counts_as_bad(frames: list[bytes]) -> bool:
    """What the worker must count: the frame count is wrong or the payload does not decode."""
    if len(frames) != 1:
        return True
    try:
        decode(frames[0])
    except ProtocolError:
        return True
    return False


def bad_frames(client: httpx.Client, cluster: Cluster) -> dict[str, float]:
    return {
        role: metric(metrics_of(client, server), BAD_FRAMES)
        for role, server in (("ctx", cluster.ctx), ("gen", cluster.gen))
    }


def wait_bad_frames(client: httpx.Client, cluster: Cluster, expected: dict[str, float]) -> None:
    # Frames travel asynchronously; the count must reach exactly `expected` (and stay there).
    wait_until(lambda: bad_frames(client, cluster) == expected, 20, f"bad frames {expected}")


@pytest.fixture(scope="module")
def gen_info(cluster: Cluster, client: httpx.Client) -> RankInfo:
    """gen's own RankInfo (gen answers REQUEST_INSTANCE_INFO too): the base of forgeries."""
    with dealer(info_endpoint(client, cluster.gen)) as socket:
        reply = request(socket, RequestInstanceInfo(protocol_version=PROTOCOL_VERSION))
    assert isinstance(reply, InstanceInfo)
    return reply.ranks[0]


def assert_still_transfers(client: httpx.Client, cluster: Cluster) -> None:
    for server in cluster.workers:
        assert server.alive(), server.log()[-4000:]
    body = completion([7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], 5)
    assert split(client, cluster, body) == aggregated(client, cluster.ctx.url, body)
    for server in cluster.workers:
        wait_idle(client, server)


# ---- strategies ----

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)  # what msgpack can encode at all
    | st.floats(allow_nan=False)
    | st.text(max_size=10)
    | st.binary(max_size=16)
)
MSGPACK_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = [
    "protocol_version", "ranks", "info", "instance_name", "instance_rank", "accepted", "reason",
    "key", "block_ids", "num_tokens", "status", "num_bytes", "num_descriptors", "error",
]  # fmt: skip
_HOSTILE = st.sampled_from([-1, 0, 1, 2**63, 2**64 - 1, "", "ok", b"\x00" * 9, [], {}, None, True])
TAGGED = st.fixed_dictionaries(
    {"type": st.sampled_from([*MESSAGE_TAGS.values(), "BOGUS", "", "request_data"])},
    optional={name: _HOSTILE | MSGPACK_VALUES for name in _FIELDS},
)
NAMES = st.text(string.ascii_letters + string.digits + "#-", min_size=1, max_size=12)
KEYS = st.integers(0, 2**63 - 1)
VALID_BUT_POINTLESS = st.one_of(
    st.builds(Cancel, key=KEYS, instance_name=NAMES, instance_rank=st.integers(0, 9)),
    st.builds(
        TransferResult,
        key=KEYS,
        instance_name=NAMES,
        instance_rank=st.integers(0, 9),
        status=st.sampled_from(ResultStatus),
        num_bytes=st.integers(0, 2**40),
    ),
    st.builds(
        RequestData,
        key=KEYS,
        instance_name=NAMES,
        instance_rank=st.integers(0, 9),
        block_ids=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4).map(
            lambda ids: (pack_block_ids(ids),)
        ),
        num_tokens=st.integers(1, 2**40),
    ),
    st.builds(WriteNotice, key=KEYS, instance_name=NAMES, instance_rank=st.integers(0, 9)),
    st.builds(
        RegisterAck, instance_name=NAMES, instance_rank=st.integers(0, 9), accepted=st.booleans()
    ),
    st.builds(InstanceInfo, protocol_version=st.integers(0, 9), ranks=st.just(())),
).map(encode)
FRAMES = st.one_of(
    st.lists(st.binary(max_size=64), min_size=1, max_size=4),
    st.lists(MSGPACK_VALUES.map(msgpack.packb), min_size=1, max_size=2),
    TAGGED.map(msgpack.packb).map(lambda payload: [payload]),
    VALID_BUT_POINTLESS.map(lambda payload: [payload]),
    st.lists(VALID_BUT_POINTLESS, min_size=2, max_size=3),  # good payloads, wrong frame count
)


# ---- tests ----


def test_random_frames_are_counted_and_dropped(cluster: Cluster, client: httpx.Client) -> None:
    expected = bad_frames(client, cluster)
    with contextlib.ExitStack() as stack:
        sockets = {
            role: stack.enter_context(dealer(info_endpoint(client, server)))
            for role, server in (("ctx", cluster.ctx), ("gen", cluster.gen))
        }

        @FUZZ
        @given(role=st.sampled_from(["ctx", "gen"]), frames=FRAMES)
        def send(role: str, frames: list[bytes]) -> None:
            sockets[role].send_multipart(frames)
            expected[role] += counts_as_bad(frames)

        send()
    wait_bad_frames(client, cluster, expected)
    assert_still_transfers(client, cluster)
    assert bad_frames(client, cluster) == expected


def test_handshakes_of_another_version_or_setting_are_refused(
    cluster: Cluster, client: httpx.Client, gen_info: RankInfo
) -> None:
    before = bad_frames(client, cluster)
    with dealer(info_endpoint(client, cluster.ctx)) as socket:
        # A newer gen learns ctx's version, so it can refuse with both values.
        reply = request(socket, RequestInstanceInfo(protocol_version=PROTOCOL_VERSION + 998))
        assert isinstance(reply, InstanceInfo) and reply.protocol_version == PROTOCOL_VERSION
        refusals = [
            ({"protocol_version": 999}, f"protocol_version: local {PROTOCOL_VERSION} vs peer 999"),
            ({"dtype": "bfloat16", "element_bytes": 2}, "dtype: local 'float32' vs peer"),
            ({"tokens_per_block": 32}, "tokens_per_block: local 16 vs peer 32"),
            ({"agent_metadata": b"not nixl metadata"}, "cannot load remote agent"),
        ]
        for i, (changes, reason) in enumerate(refusals):
            forged = attrs.evolve(gen_info, instance_name=f"forged-{i}", **changes)
            ack = request(socket, RegisterPeer(info=forged))
            assert isinstance(ack, RegisterAck) and not ack.accepted, ack
            assert reason in ack.reason, ack.reason
    assert bad_frames(client, cluster) == before
    assert_still_transfers(client, cluster)


_RANK_FIELDS = {
    "instance_rank": st.integers(-1, 4),
    "tp_size": st.integers(-1, 4),
    "tp_rank": st.integers(-1, 4),
    "pp_size": st.integers(-1, 4),
    "pp_rank": st.integers(-1, 4),
    "dp_size": st.integers(-1, 4),
    "dp_rank": st.integers(-1, 4),
    "layer_num_per_pp": st.lists(st.integers(-1, 6), max_size=3),
    "num_kv_heads": st.integers(-1, 8),
    "kv_heads_per_rank": st.integers(-1, 8),
    "head_dim": st.integers(-1, 64),
    "tokens_per_block": st.sampled_from([0, 8, 16, 32]),
    "element_bytes": st.integers(-1, 4),
    "layout": st.sampled_from(["HND", "NHD", "XYZ", 3]),
    "control_endpoint": st.sampled_from(["tcp://foo", "tcp://127.0.0.1:1", "tcp://*:1", ""]),
    "model_fingerprint": st.text(max_size=8),
}


# One or two fields at a time: more changes than that rarely decode, and decoded ones are the
# ones that reach the registrar.
_RANK_CHANGES = st.lists(st.sampled_from(sorted(_RANK_FIELDS)), max_size=2, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({name: _RANK_FIELDS[name] for name in names})
)


@FUZZ
@given(changes=_RANK_CHANGES, salt=st.integers(0, 10**9))
def test_registrations_with_hostile_rank_info_get_an_answer_or_are_dropped(
    cluster: Cluster,
    client: httpx.Client,
    gen_info: RankInfo,
    changes: dict[str, Any],
    salt: int,
) -> None:
    """A RankInfo whose fields contradict each other never reaches the registrar (decoding
    refuses it); one that decodes is answered, accepted or refused, and nothing crashes."""
    message = msgpack.unpackb(encode(RegisterPeer(info=gen_info)))
    # A fresh name per example (a refusal is cached per instance) and metadata NIXL refuses,
    # so no accepted forgery loads a real agent.
    message["info"].update(instance_name=f"forged-{salt}", agent_metadata=b"x", **changes)
    payload = msgpack.packb(message)
    before = bad_frames(client, cluster)["ctx"]
    event("decodes" if not counts_as_bad([payload]) else "does not decode")
    with dealer(info_endpoint(client, cluster.ctx)) as socket:
        socket.send(payload)
        if counts_as_bad([payload]):
            wait_until(lambda: bad_frames(client, cluster)["ctx"] == before + 1, 20, "counted")
        else:
            ack = decode(socket.recv())
            assert isinstance(ack, RegisterAck) and not ack.accepted, ack
    assert cluster.ctx.alive(), cluster.ctx.log()[-4000:]


def test_a_forged_peer_is_answered_where_it_says_and_cannot_name_a_bad_endpoint(
    cluster: Cluster, client: httpx.Client, gen_info: RankInfo
) -> None:
    """A registration that passes the gate (gen's own agent, another name) is accepted: the
    control plane trusts whoever reaches it, which is why it listens on loopback only. ctx then
    answers that peer's stray REQUEST_DATA at the endpoint the peer named, once the transfer
    timeout has passed. An endpoint zmq cannot parse never gets that far: the registration
    carrying it does not decode."""
    inbox = zmq.Context.instance().socket(zmq.ROUTER)
    inbox.setsockopt(zmq.RCVTIMEO, TRANSFER_TIMEOUT_MS + REPLY_TIMEOUT_MS)
    inbox.bind("tcp://127.0.0.1:*")
    try:
        endpoint = inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        forged = attrs.evolve(gen_info, instance_name="forged-peer", control_endpoint=endpoint)
        with dealer(info_endpoint(client, cluster.ctx)) as socket:
            ack = request(socket, RegisterPeer(info=forged))
            assert isinstance(ack, RegisterAck) and ack.accepted, ack
            socket.send(encode(_stray(2**55 + 1, "forged-peer")))
            assert _refusal(inbox) == 2**55 + 1
            before = bad_frames(client, cluster)["ctx"]
            message = msgpack.unpackb(encode(RegisterPeer(info=forged)))
            message["info"].update(instance_name="forged-junk", control_endpoint="tcp://foo")
            socket.send(msgpack.packb(message))
            wait_until(lambda: bad_frames(client, cluster)["ctx"] == before + 1, 20, "counted")
            # Had that registration been accepted, ctx would answer this stray request at
            # "tcp://foo" once it goes stale, and zmq would raise. The next stray request goes
            # stale no earlier, so its answer arriving shows ctx got past the first one.
            socket.send(encode(_stray(2**55 + 2, "forged-junk")))
            socket.send(encode(_stray(2**55 + 3, "forged-peer")))
            assert _refusal(inbox) == 2**55 + 3
    finally:
        inbox.close(linger=0)
    assert_still_transfers(client, cluster)


def _stray(key: int, instance_name: str) -> RequestData:
    """A REQUEST_DATA for a transfer ctx never heard of."""
    ids = (pack_block_ids([0]),)
    return RequestData(key=key, instance_name=instance_name, instance_rank=0, block_ids=ids,
                       num_tokens=16)  # fmt: skip


def _refusal(inbox: zmq.Socket[bytes]) -> int:
    """The key of the next TRANSFER_RESULT at `inbox`, which must be ctx's refusal."""
    _identity, payload = inbox.recv_multipart()
    result = decode(payload)
    assert isinstance(result, TransferResult) and result.status is ResultStatus.ERROR, result
    assert f"transfer key {result.key}" in result.error, result.error
    return result.key


def test_after_all_of_it_a_transfer_still_works(cluster: Cluster, client: httpx.Client) -> None:
    assert_still_transfers(client, cluster)
