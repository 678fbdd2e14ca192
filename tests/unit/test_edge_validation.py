"""Validation at the edges: endpoints from clients and peers, JSON depth, 64-bit ranges."""

from __future__ import annotations

import json
import string

import attrs
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.rank_infos import make_instance
from trtdisagg.api.codec import MAX_JSON_DEPTH, parse_json, structure_body, validate_request
from trtdisagg.api.errors import ApiError
from trtdisagg.api.protocol import CompletionRequest
from trtdisagg.transfer.protocol.rank_info import is_tcp_endpoint


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://127.0.0.1:5555", "tcp://[::1]:1", "tcp://localhost:65535", "tcp://ctx-0.svc.local:80"],
)
def test_plain_endpoints_pass(endpoint: str) -> None:
    assert is_tcp_endpoint(endpoint)


@pytest.mark.parametrize(
    "endpoint",
    [
        "", "tcp://", "tcp://foo", "tcp://:5", "tcp://*:5", "tcp://a b:5", "tcp://-:5", "tcp://.:5",
        "tcp://127.0.0.1:0", "tcp://127.0.0.1:65536", "tcp://127.0.0.1:-1", "tcp://1.2.3.4:99999",
        "tcp://127.0.0.1:5;127.0.0.1:6", "tcp://[zz]:5", "tcp://[1.2.3.4]:5", "tcp://::1:5",
        "ipc:///tmp/x", "inproc://x", "udp://127.0.0.1:5", "tcp://127.0.0.1:5/x", "tcp://a_b:5",
        "tcp://a:\u00b2", "tcp://a:\u0663\u0664",  # digits to str.isdigit, not to zmq
    ],
)  # fmt: skip
def test_anything_else_is_refused(endpoint: str) -> None:
    assert not is_tcp_endpoint(endpoint)


_ENDPOINTISH = st.builds(
    "{}{}:{}".format,
    st.sampled_from(["tcp://", "tcp://[", "ipc://", ""]),
    st.text(string.ascii_letters + string.digits + ".-:[]*;_ %", max_size=24),
    st.text(string.digits + "-", max_size=6),
)


@settings(max_examples=400, deadline=None, database=None)
@given(endpoint=_ENDPOINTISH | st.text(max_size=30))
def test_what_passes_is_an_endpoint_zmq_accepts(endpoint: str) -> None:
    """The property the check exists for: nothing it lets through makes zmq.connect raise."""
    if not is_tcp_endpoint(endpoint):
        return
    socket = zmq.Context.instance().socket(zmq.DEALER)
    try:
        socket.connect(endpoint)  # asynchronous: no traffic, only parsing
    finally:
        socket.close(linger=0)


def test_rank_info_refuses_a_control_endpoint_zmq_would_choke_on() -> None:
    sizes = {"tp_size": 1, "pp_size": 1, "layer_num_per_pp": (2,), "num_kv_heads": 2}
    info = make_instance(
        instance_name="gen", head_dim=8, tokens_per_block=16, num_slots=4, **sizes
    )[0]
    with pytest.raises(ValueError, match="control_endpoint 'tcp://foo' is not tcp://host:port"):
        attrs.evolve(info, control_endpoint="tcp://foo")


def test_json_nested_deeper_than_the_limit_is_a_400() -> None:
    ok = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json(ok) is not None
    for depth in (MAX_JSON_DEPTH + 1, 5000):  # 5000 also exceeds Python's own json recursion
        with pytest.raises(ApiError, match="nests deeper than") as info:
            parse_json("[" * depth + "]" * depth)
        assert info.value.status == 400
    wide = json.dumps({"prompt": list(range(100_000)), "x": [{"a": [1]}] * 1000})
    assert isinstance(parse_json(wide), dict)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**63}, "seed"),  # torch takes up to 2**64 - 1, OpenAI's seed is an int64
        ({"seed": -(2**63) - 1}, "seed"),
        ({"disaggregated_params": {"disagg_request_id": 2**63}}, "disagg_request_id"),
        ({"disaggregated_params": {"disagg_request_id": -1}}, "disagg_request_id"),
    ],
)
def test_values_beyond_64_bits_are_a_400(change: dict[str, object], field: str) -> None:
    req = structure_body({"prompt": "hi", **change}, CompletionRequest)
    with pytest.raises(ApiError, match=field) as info:
        validate_request(req)
    assert info.value.status == 400


def test_64_bit_extremes_pass() -> None:
    for seed in (-(2**63), 2**63 - 1):
        validate_request(structure_body({"prompt": "hi", "seed": seed}, CompletionRequest))
    params = {"disagg_request_id": 2**63 - 1}
    validate_request(
        structure_body({"prompt": "hi", "disaggregated_params": params}, CompletionRequest)
    )
