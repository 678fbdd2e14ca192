"""What libzmq and pyzmq do with CURVE, ZAP, metadata and MAXMSGSIZE: the behaviours
trtdisagg/security relies on, each checked on real sockets (tcp on 127.0.0.1), one line each.

Why: the control plane's security rests on libzmq details that its documentation leaves open or
states loosely (when ZAP is consulted, whose User-Id wins, what a ZAP request carries, whether
the message cap applies before authentication). This script re-checks them on the installed
pyzmq/libzmq; run it after upgrading either.

    python tools/probe_zmq_security.py

Plain blocking pyzmq with a poller; every socket and context it opens, it closes.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import timeit

import zmq
from _zmq_probe_common import (
    ZAP,
    Socket,
    context,
    curve_dealer,
    curve_router,
    greeting,
    prop,
    pump,
    raw_null_client,
    rss,
)
from zmq.utils import z85


def report(title: str, finding: object) -> None:
    print(f"- {title}: {finding}")


def probe_options_and_zap_request() -> None:
    with context() as make:
        sp, ss = zmq.curve_keypair()
        cp, cs = zmq.curve_keypair()
        zap = make(zmq.ROUTER)
        zap.bind(ZAP)
        router, endpoint = curve_router(
            make,
            ss,
            sp,
            ZAP_DOMAIN=b"probe",
            ZAP_ENFORCE_DOMAIN=1,
            ROUTING_ID=b"server-own-id",
            METADATA=b"X-Label:server#0",
        )
        report("ZMQ_METADATA and ZMQ_ZAP_ENFORCE_DOMAIN on a non-draft libzmq", "accepted")
        dealer = curve_dealer(make, sp, (cp, cs))
        dealer.setsockopt(zmq.ROUTING_ID, b"client-id")
        dealer.setsockopt(zmq.METADATA, b"X-Label:gen-0#3")
        dealer.connect(endpoint)
        dealer.send(b"hello")
        seen = pump({"zap": zap, "router": router}, 5, until=lambda s: bool(s["router"]))
        request = seen["zap"][0]
        assert isinstance(request, list)
        names = [
            "routing id",
            "delimiter",
            "version",
            "request id",
            "domain",
            "address",
            "identity",
            "mechanism",
            "credentials",
        ]
        shown = {
            n: (f"z85 {z85.encode(v).decode()}" if n == "credentials" else v)
            for n, v in zip(names, request)
        }
        report("ZAP request as a ROUTER handler receives it", shown)
        report("  credentials == the client's public key", z85.encode(request[8]) == cp)
        frames = seen["router"][0]
        assert isinstance(frames, list)
        props = {
            n: prop(frames[-1], n)
            for n in ("User-Id", "X-Label", "Peer-Address", "Socket-Type", "Identity", "X-Missing")
        }
        report("properties of a received frame (recv copy=False)", props)
        report(
            "  same on the routing-id frame", all(prop(frames[0], n) == v for n, v in props.items())
        )
        router.send_multipart([frames[0].bytes, b"reply"])
        reply = dealer.recv(copy=False)
        report(
            "properties a DEALER sees on the server's reply",
            {n: prop(reply, n) for n in ("User-Id", "X-Label")},
        )
        try:
            dealer2 = make(zmq.DEALER)
            dealer2.setsockopt(zmq.METADATA, b"User-Id:forged")
            report("setsockopt(METADATA, 'User-Id:...')", "accepted")
        except zmq.ZMQError as exc:
            report("setsockopt(METADATA, 'User-Id:...')", f"refused ({exc}): only X- names")


def probe_zap_consultation() -> None:
    rows = []
    for domain in (b"", b"probe"):
        for enforce in (0, 1):
            for handler in (True, False):
                with context() as make:
                    sp, ss = zmq.curve_keypair()
                    sockets: dict[str, Socket] = {}
                    if handler:
                        sockets["zap"] = make(zmq.ROUTER)
                        sockets["zap"].bind(ZAP)
                    opts: dict[str, int | bytes] = {"ZAP_ENFORCE_DOMAIN": enforce}
                    if domain:
                        opts["ZAP_DOMAIN"] = domain
                    sockets["router"], endpoint = curve_router(make, ss, sp, **opts)
                    dealer = curve_dealer(make, sp)
                    dealer.connect(endpoint)
                    dealer.send(b"x")
                    seen = pump(sockets, 1.0, until=lambda s: bool(s["router"]))
                    got = seen["router"]
                    uid = prop(got[0][-1], "User-Id") if got else None  # type: ignore[index]
                    asked = len(seen.get("zap", []))
                    shown = domain.decode() or "(empty)"
                    rows.append(
                        f"domain={shown} enforce={enforce} handler={'yes' if handler else 'no'}:"
                        f" ZAP asked {asked}x, delivered={bool(got)}, User-Id={uid!r}"
                    )
    report("when libzmq consults ZAP for a CURVE server", "")
    for row in rows:
        print("    " + row)


def _connect_into(
    clients: list[socket.socket], port: int, props: list[tuple[bytes, bytes]]
) -> None:
    clients.append(raw_null_client(port, props))


def probe_user_id_forgery() -> None:
    for consulted in (False, True):
        with context() as make:
            sockets: dict[str, Socket] = {}
            router = make(zmq.ROUTER)
            if consulted:
                sockets["zap"] = make(zmq.ROUTER)
                sockets["zap"].bind(ZAP)
                router.zap_domain = b"probe"
            port = router.bind_to_random_port("tcp://127.0.0.1")
            sockets["router"] = router
            props = [(b"Socket-Type", b"DEALER"), (b"User-Id", b"forged"), (b"X-Label", b"a#0")]
            clients: list[socket.socket] = []
            # In a thread: the client waits for the server's READY, which waits for ZAP's answer.
            thread = threading.Thread(target=_connect_into, args=(clients, port, props))
            thread.start()
            seen = pump(sockets, 3, until=lambda s: bool(s["router"]))
            thread.join()
            got = seen["router"]
            read = prop(got[0][-1], "User-Id") if got else "nothing arrived"  # type: ignore[index]
            report(
                f"a peer's own 'User-Id' property, ZAP consulted={consulted}", f"User-Id={read!r}"
            )
            for client in clients:
                client.close()


def probe_strangers() -> None:
    for kind in ("wrong server key", "NULL client", "ZAP answers 400"):
        with context() as make:
            sp, ss = zmq.curve_keypair()
            sockets: dict[str, Socket] = {"zap": make(zmq.ROUTER)}
            sockets["zap"].bind(ZAP)
            sockets["router"], endpoint = curve_router(
                make, ss, sp, ZAP_DOMAIN=b"probe", ZAP_ENFORCE_DOMAIN=1
            )
            if kind == "wrong server key":
                dealer = curve_dealer(make, zmq.curve_keypair()[0])
            elif kind == "NULL client":
                dealer = make(zmq.DEALER)
            else:
                dealer = curve_dealer(make, sp)
            sockets["m:client"] = dealer.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_CONNECT_RETRIED
            )
            dealer.connect(endpoint)
            dealer.send(b"x")
            seen = pump(sockets, 2, zap_code=b"400" if kind == "ZAP answers 400" else b"200")
            events = seen["m:client"]
            report(
                f"{kind} for 2 s",
                f"ZAP asked {len(seen['zap'])}x, delivered {len(seen['router'])}, client events"
                f" {sorted(set(map(str, events)))}, retries {events.count('CONNECT_RETRIED')}",
            )
            dealer.disable_monitor()
            sockets["m:client"].close(linger=0)


def probe_options_after_bind() -> None:
    with context() as make:
        sp, ss = zmq.curve_keypair()
        router = make(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        router.curve_server = True
        router.curve_secretkey = ss
        router.curve_publickey = sp
        dealer = make(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"plain")
        report("CURVE set after bind: a NULL client's message arrives", router.poll(1000) != 0)
        report("LAST_ENDPOINT of a fresh socket", make(zmq.ROUTER).getsockopt(zmq.LAST_ENDPOINT))


def probe_maxmsgsize() -> None:
    limit = 4096
    for curve in (False, True):
        with context() as make:
            sp, ss = zmq.curve_keypair()
            sockets: dict[str, Socket] = {"zap": make(zmq.ROUTER)}
            sockets["zap"].bind(ZAP)
            if curve:
                router, endpoint = curve_router(
                    make, ss, sp, ZAP_DOMAIN=b"probe", ZAP_ENFORCE_DOMAIN=1, MAXMSGSIZE=limit
                )
                dealer = curve_dealer(make, sp)
            else:
                router = make(zmq.ROUTER)
                router.setsockopt(zmq.MAXMSGSIZE, limit)
                endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
                dealer = make(zmq.DEALER)
            sockets["router"] = router
            dealer.connect(endpoint)
            largest = 0
            for size in range(limit - 40, limit + 2):
                dealer.send(b"y" * size)
                if pump(sockets, 0.3, until=lambda s: bool(s["router"]))["router"]:
                    largest = size
            report(
                f"MAXMSGSIZE={limit}, CURVE={curve}: largest message delivered",
                f"{largest} (cap - {limit - largest})",
            )
    with context() as make:
        sp, ss = zmq.curve_keypair()
        sockets = {"zap": make(zmq.ROUTER)}
        sockets["zap"].bind(ZAP)
        sockets["router"], endpoint = curve_router(
            make, ss, sp, ZAP_DOMAIN=b"probe", ZAP_ENFORCE_DOMAIN=1, MAXMSGSIZE=1 << 20
        )
        dealer = curve_dealer(make, sp)
        dealer.connect(endpoint)
        dealer.send(b"z" * (2 << 20))
        dealer.send(b"after")
        seen = pump(sockets, 3, until=lambda s: bool(s["router"]))
        got = [len(f[-1].bytes) for f in seen["router"]]  # type: ignore[index]
        report(
            "a 2 MiB message at a 1 MiB cap, then 'after'",
            f"delivered sizes {got}; ZAP asked {len(seen['zap'])}x (the DEALER reconnected)",
        )


def flood_handshake(port: int, outcome: list[str]) -> None:
    """Greet as a CURVE client, then declare a 1 GiB command and stream 300 MiB of it."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(greeting(b"CURVE"))
    got = b""
    while len(got) < 64:
        got += s.recv(64 - len(got))
    s.sendall(b"\x06" + struct.pack(">Q", 1 << 30))
    sent, chunk = 0, bytes(1 << 20)
    try:
        while sent < 300 << 20:
            s.sendall(chunk)
            sent += len(chunk)
        outcome.append(f"streamed all {sent >> 20} MiB")
    except OSError as exc:
        outcome.append(f"cut after {sent >> 20} MiB ({type(exc).__name__})")
    s.close()


def probe_unauthenticated_huge_frame() -> None:
    for cap in (-1, 1 << 20):
        with context() as make:
            sp, ss = zmq.curve_keypair()
            router = make(zmq.ROUTER)
            router.curve_server = True
            router.curve_secretkey = ss
            router.curve_publickey = sp
            if cap >= 0:
                router.setsockopt(zmq.MAXMSGSIZE, cap)
            port = router.bind_to_random_port("tcp://127.0.0.1")
            outcome: list[str] = []
            base = peak = rss()
            thread = threading.Thread(target=flood_handshake, args=(port, outcome))
            thread.start()
            while thread.is_alive():
                peak = max(peak, rss())
                time.sleep(0.05)
            report(
                f"a stranger declares a 1 GiB handshake frame, MAXMSGSIZE={cap}",
                f"{outcome[0]}; RSS +{(peak - base) >> 20} MiB",
            )


def probe_handshake_timeout() -> None:
    with context() as make:
        sp, ss = zmq.curve_keypair()
        _, endpoint = curve_router(make, ss, sp, HANDSHAKE_IVL=500)
        s = socket.create_connection(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])))
        s.settimeout(5)
        s.sendall(greeting(b"CURVE"))
        start = time.monotonic()
        try:
            while s.recv(4096):
                pass
            report(
                "HANDSHAKE_IVL=500 ms, a peer that greets and stalls",
                f"closed after {time.monotonic() - start:.2f} s",
            )
        except TimeoutError:
            report("HANDSHAKE_IVL=500 ms, a peer that greets and stalls", "not closed within 5 s")
        s.close()


def probe_metadata_decoding() -> None:
    with context() as make:
        router = make(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        for value in (b"\xff\xfe#0", b"victim#0\x00junk"):
            raw = raw_null_client(port, [(b"Socket-Type", b"DEALER"), (b"X-Label", value)])
            if router.poll(2000):
                frames = router.recv_multipart(copy=False)
                report(
                    f"peer metadata X-Label={value!r} read with Frame.get",
                    prop(frames[-1], "X-Label"),
                )
            raw.close()
        raw = raw_null_client(port, [(b"Socket-Type", b"DEALER")], pipelined=True)
        report(
            "a NULL peer sending greeting, READY and a message in one write: message arrives",
            router.poll(1000) != 0,
        )
        raw.close()


def probe_zap_rebind() -> None:
    with context() as make:
        failures = 0
        for _ in range(500):
            s = make(zmq.ROUTER)
            try:
                s.bind(ZAP)
            except zmq.ZMQError:
                failures += 1
            s.close(linger=0)
        report(
            "binding the ZAP endpoint right after closing its previous socket",
            f"failed {failures} of 500",
        )


def probe_costs() -> None:
    secret = z85.encode(bytes(range(32)))
    n = 2000
    report(
        "zmq.curve_public",
        f"{timeit.timeit(lambda: zmq.curve_public(secret), number=n) / n * 1e6:.1f} us per call",
    )
    with context() as make:
        router = make(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = make(zmq.DEALER)
        dealer.setsockopt(zmq.METADATA, b"X-Label:gen-0123456789abcdef#0")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        for _ in range(n):
            dealer.send(b"m" * 100)
        while not int(router.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            router.poll(100)
        time.sleep(0.5)  # let all n arrive: this measures receiving, not the network
        start = time.perf_counter()
        for _ in range(n // 2):
            router.recv_multipart()
        copied = (time.perf_counter() - start) / (n // 2)
        start = time.perf_counter()
        for _ in range(n // 2):
            frames = router.recv_multipart(copy=False)
            prop(frames[-1], "User-Id")
            prop(frames[-1], "X-Label")
            prop(frames[-1], "Peer-Address")
            kept = (frames[0].bytes, frames[1].bytes)  # what a pump would keep
            del kept
        uncopied = (time.perf_counter() - start) / (n // 2)
        report(
            "receiving a 100-byte message",
            f"copy=True {copied * 1e6:.1f} us;"
            f" copy=False + 3 properties + bytes {uncopied * 1e6:.1f} us",
        )


def main() -> None:
    print(f"pyzmq {zmq.pyzmq_version()}, libzmq {zmq.zmq_version()}", end=", ")
    print(f"CURVE {zmq.has('curve')}, draft API {zmq.has('draft')}")
    for probe in (
        probe_options_and_zap_request,
        probe_zap_consultation,
        probe_user_id_forgery,
        probe_strangers,
        probe_options_after_bind,
        probe_maxmsgsize,
        probe_unauthenticated_huge_frame,
        probe_handshake_timeout,
        probe_metadata_decoding,
        probe_zap_rebind,
        probe_costs,
    ):
        probe()


if __name__ == "__main__":
    main()
