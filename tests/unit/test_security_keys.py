"""trtdisagg/security: the secret's rules, key derivation, labels, the per-connection verifier,
the bind policy and the ZAP decision. No sockets here (tests/integration/test_security_curve.py
has them)."""

from __future__ import annotations

import logging

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st
from zmq.utils import z85

from trtdisagg.config import ConfigError
from trtdisagg.security.keys import (
    PeerLabel,
    client_keypair,
    derive_key_material,
    server_keypair,
)
from trtdisagg.security.policy import (
    ControlPlaneMode,
    InsecureControlPlane,
    control_plane_mode,
    is_loopback_host,
)
from trtdisagg.security.secret import (
    ClusterSecret,
    InvalidClusterSecret,
    cluster_secret_of,
    resolve_cluster_secret,
)
from trtdisagg.security.sockets import ZAP_DOMAIN
from trtdisagg.security.verify import ConnectionClaims, PeerVerifier, verify_peer
from trtdisagg.security.zap import ZAP_VERSION, answer_zap

SECRET = ClusterSecret.parse("correct horse battery staple")
GEN0 = PeerLabel(instance_name="gen-0123456789abcdef", instance_rank=0)
GEN3 = PeerLabel(instance_name="gen-0123456789abcdef", instance_rank=3)


# ---- the secret ----


def test_a_secret_is_checked_and_never_shown() -> None:
    text = "s3cret-" + "x" * 20
    secret = ClusterSecret.parse(text)
    assert secret.value == text.encode()
    assert text not in repr(secret) and text not in str(secret)
    assert secret == ClusterSecret.parse(text) != ClusterSecret.parse(text + "y")
    for bad, words in [
        ("x" * 15, "at least 16"),
        ("", "at least 16"),
        ("x" * 20 + "\n", "whitespace"),
        (" " + "x" * 20, "whitespace"),
    ]:
        with pytest.raises(InvalidClusterSecret, match=words) as caught:
            ClusterSecret.parse(bad)
        message = str(caught.value)
        assert "cache_transceiver_config.cluster_secret" in message
        assert "TRTDISAGG_CLUSTER_SECRET" in message
        assert "x" * 15 not in message  # never the value


def test_the_environment_wins_and_empty_counts_as_unset() -> None:
    assert resolve_cluster_secret("from-config", "from-env") == "from-env"
    assert resolve_cluster_secret("from-config", "") == "from-config"
    assert resolve_cluster_secret("from-config", None) == "from-config"
    assert resolve_cluster_secret(None, None) is None
    assert cluster_secret_of(None) is None
    assert cluster_secret_of("y" * 16) == ClusterSecret.parse("y" * 16)


# ---- keys ----


def test_derivation_is_stable_across_versions() -> None:
    """Known answers: every process of a cluster must derive the same keys, whatever version
    it runs. HMAC-SHA256(secret, purpose) checked independently with `openssl dgst -sha256
    -hmac`; the public keys are libzmq's for those secret keys."""
    material = derive_key_material(SECRET, b"trtdisagg-curve-v1/server")
    assert material.hex() == "9283d600fa11d1a0b49dda9225f3e5604092876986f3416630d54eacde5490d7"
    server = server_keypair(SECRET)
    assert server.secret == z85.encode(material)
    assert server.public == b"=t-c[I{Fo:Gs/x[fXU!&C]<3?67oc-g5e<iY+Br^"
    assert client_keypair(SECRET, GEN3).public == b"ifV.i)rG7b[vMFfa[P^hy6*fju::[JioIe3.EKTk"


def test_keys_differ_by_purpose_label_and_secret() -> None:
    other = ClusterSecret.parse("another secret of the cluster")
    publics = {
        server_keypair(SECRET).public,
        server_keypair(other).public,
        client_keypair(SECRET, GEN0).public,
        client_keypair(SECRET, GEN3).public,
        client_keypair(other, GEN0).public,
    }
    assert len(publics) == 5
    for keys in (server_keypair(SECRET), client_keypair(SECRET, GEN0)):
        assert len(keys.public) == len(keys.secret) == 40
        assert zmq.curve_public(keys.secret) == keys.public
        assert keys.secret.decode() not in repr(keys)


def test_a_label_round_trips_and_refuses_anything_else() -> None:
    assert GEN3.text == "gen-0123456789abcdef#3"
    assert PeerLabel.parse(GEN3.text) == GEN3
    assert GEN3.key == ("gen-0123456789abcdef", 3)
    for bad in ["", "gen", "gen#", "#0", "gen#-1", "gen#01", "gen#x", "gen#٣", "a b#0",
                "gen#0#1", "gen#65536", "g" * 95 + "#0", "ctx/0"]:  # fmt: skip
        with pytest.raises(ValueError):
            PeerLabel.parse(bad)


@given(st.text(max_size=120))
def test_parsing_any_text_gives_a_label_or_value_error(text: str) -> None:
    try:
        label = PeerLabel.parse(text)
    except ValueError:
        return
    assert label.text == text


# ---- the verifier ----


def _user_id(label: PeerLabel, secret: ClusterSecret = SECRET) -> str:
    return client_keypair(secret, label).public.decode()


def test_a_label_is_accepted_only_with_its_own_key() -> None:
    assert verify_peer(SECRET, GEN3.text, _user_id(GEN3)) == GEN3
    assert verify_peer(SECRET, GEN3.text, _user_id(GEN0)) is None  # another rank's key
    other = ClusterSecret.parse("another secret of the cluster")
    assert verify_peer(SECRET, GEN3.text, _user_id(GEN3, other)) is None  # another cluster's
    stranger = zmq.curve_keypair()[0].decode()
    assert verify_peer(SECRET, GEN3.text, stranger) is None
    assert verify_peer(SECRET, None, _user_id(GEN3)) is None  # no label sent
    assert verify_peer(SECRET, GEN3.text, None) is None  # no User-Id: ZAP never saw it
    assert verify_peer(SECRET, GEN3.text, "") is None
    assert verify_peer(SECRET, GEN3.text + "x", _user_id(GEN3)) is None
    assert verify_peer(SECRET, "x" * 10_000, _user_id(GEN3)) is None
    assert verify_peer(SECRET, GEN3.text, _user_id(GEN3) + "=") is None


def test_the_verifier_remembers_a_bounded_number_of_answers() -> None:
    verifier = PeerVerifier(secret=SECRET, memo_size=2)
    assert verifier.verify(GEN3.text, _user_id(GEN3)) == GEN3
    assert verifier.verify(GEN3.text, _user_id(GEN3)) == GEN3
    for rank in range(5):  # claims that do not match: refused, and the memo stays small
        assert verifier.verify(f"gen-x#{rank}", _user_id(GEN0)) is None
        assert len(verifier._memo) <= 2
    assert verifier.verify(None, None) is None
    assert verifier.verify(GEN0.text, _user_id(GEN0)) == GEN0
    stats = verifier.statistics()
    assert (stats.accepted, stats.refused) == (3, 6)


def test_admit_counts_refusals_and_logs_them_within_the_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    verifier = PeerVerifier(secret=SECRET)
    member = ConnectionClaims(user_id=_user_id(GEN3), label=GEN3.text, address="10.0.0.3")
    impostor_key = zmq.curve_keypair()[0].decode()
    impostor = ConnectionClaims(user_id=impostor_key, label=GEN3.text, address="10.0.0.9")
    with caplog.at_level(logging.WARNING, logger="trtdisagg.security.verify"):
        assert verifier.admit(member, 0.0) == GEN3
        assert [verifier.admit(impostor, float(t)) for t in range(10)] == [None] * 10
        assert verifier.admit(impostor, 61.0) is None  # a new window: one line with the count
        verifier.flush_warnings(200.0)  # nothing pending
    stats = verifier.statistics()
    assert (stats.accepted, stats.refused) == (1, 11)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 4  # 3 in the first minute, then 1 saying 7 were suppressed
    assert all(impostor_key in line and "10.0.0.9" in line for line in lines)
    assert lines[-1].endswith("(7 similar lines suppressed)")


# ---- the bind policy ----


def test_without_a_secret_only_loopback_binds_run() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        assert is_loopback_host(host), host
        assert control_plane_mode(host, None) is ControlPlaneMode.UNSECURED_LOOPBACK
    for host in ("0.0.0.0", "::", "192.0.2.2", "ctx-0.cluster.local", "localhost.example"):
        assert not is_loopback_host(host), host
        with pytest.raises(InsecureControlPlane) as caught:
            control_plane_mode(host, None)
        assert isinstance(caught.value, ConfigError)  # cli reports it as a config error
        message = str(caught.value)
        assert "cache_transceiver_config.cluster_secret" in message
        assert "TRTDISAGG_CLUSTER_SECRET" in message
        assert host in message
        assert control_plane_mode(host, SECRET) is ControlPlaneMode.CURVE
    assert control_plane_mode("127.0.0.1", SECRET) is ControlPlaneMode.CURVE


# ---- the ZAP decision ----

_KEY = bytes(range(32))


def _request(*, version: bytes = ZAP_VERSION, domain: bytes = ZAP_DOMAIN,
             mechanism: bytes = b"CURVE", credentials: tuple[bytes, ...] = (_KEY,),
             ) -> list[bytes]:  # fmt: skip
    return [b"\x00peer", b"", version, b"7", domain, b"127.0.0.1", b"", mechanism, *credentials]


def test_zap_admits_a_curve_client_with_its_key_as_user_id() -> None:
    answer = answer_zap(_request())
    assert answer.accepted
    assert answer.reply == (b"\x00peer", b"", b"1.0", b"7", b"200", b"OK", z85.encode(_KEY), b"")


@pytest.mark.parametrize(
    ("request_frames", "reason"),
    [
        (_request(version=b"2.0"), "unsupported ZAP version"),
        (_request(domain=b"other"), "unknown domain"),
        (_request(domain=b""), "unknown domain"),
        (_request(mechanism=b"NULL", credentials=()), "CURVE only"),
        (_request(mechanism=b"PLAIN", credentials=(b"user", b"password")), "CURVE only"),
        (_request(credentials=()), "malformed CURVE credentials"),
        (_request(credentials=(_KEY[:31],)), "malformed CURVE credentials"),
        (_request(credentials=(_KEY, _KEY)), "malformed CURVE credentials"),
        ([b"\x00peer", b"", b"1.0", b"7"], "malformed request"),
    ],
)
def test_zap_refuses_anything_else(request_frames: list[bytes], reason: str) -> None:
    answer = answer_zap(request_frames)
    assert not answer.accepted and answer.reason == reason
    assert answer.reply == (b"\x00peer", b"", b"1.0", b"7", b"400", reason.encode(), b"", b"")


def test_a_zap_request_without_an_envelope_gets_no_reply() -> None:
    body = [b"1.0", b"7", ZAP_DOMAIN, b"127.0.0.1", b"", b"CURVE", _KEY]
    for frames in (body, [b"\x00peer", *body], [b"", b"", *body], [b"\x00peer"], []):
        answer = answer_zap(frames)
        assert answer.reply is None and not answer.accepted, frames
