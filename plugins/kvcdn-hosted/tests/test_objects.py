"""Signed object GETs read straight into memory (kvcdn_hosted.objects), against real loopback HTTP
and HTTPS servers: the bytes, kept-alive connections, a connection the server dropped while idle,
the statuses, bodies of the wrong length, a proxy from the environment, TLS verification, and many
threads at once."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvcdn_core import KvcdnError
from kvcdn_hosted.objects import ObjectReader


def reader() -> ObjectReader:
    return ObjectReader(httpx.Client(), "kvcdn-test")


def body_of(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(n))


def serve_bytes(receiver, path: str, payload: bytes, ports: list | None = None) -> str:
    def route(handler):
        if ports is not None:
            ports.append(handler.client_address[1])
        return 200, {"Content-Type": "application/octet-stream"}, payload

    receiver.routes[("GET", path)] = route
    return f"{receiver.url}{path}?sig=abc"


def test_the_body_lands_in_the_callers_buffer_and_the_connection_is_kept(receiver):
    payload = body_of(300_000)
    ports: list[int] = []
    url = serve_bytes(receiver, "/o/a", payload, ports)
    objects = reader()
    into = memoryview(bytearray(len(payload)))
    assert objects.get(url, into) is into
    assert bytes(into) == payload
    assert objects.get(url) == payload  # no buffer: the bytes
    assert len(ports) == 2 and ports[0] == ports[1]  # one TCP connection for both
    path, headers = receiver.requests[0][1], receiver.requests[0][2]
    assert path == "/o/a?sig=abc" and headers["User-Agent"] == "kvcdn-test"
    assert "Authorization" not in headers  # the URL is the credential
    objects.close()


def test_landed_is_told_as_the_body_arrives_through_either_path(receiver, monkeypatch):
    """A reader (the vLLM tier) may use the front of a body before its end: ``landed`` is told, in
    order, how many of the buffer's first bytes are in place, the last time all of them; through
    http.client and through httpx (a proxy) alike."""
    from kvcdn_core.store.pack import LANDED_STEP

    payload = body_of(3 * LANDED_STEP + 1000)
    url = serve_bytes(receiver, "/o/l", payload)
    for proxied in (False, True):
        if proxied:  # the receiver as the proxy (asked for the absolute URL): the GET goes through httpx
            receiver.routes[("GET", url.split("?")[0])] = lambda h: (200, {}, payload)
            monkeypatch.setenv("HTTP_PROXY", receiver.url)
            for name in ("NO_PROXY", "no_proxy", "http_proxy"):
                monkeypatch.delenv(name, raising=False)
        told: list[int] = []
        into = memoryview(bytearray(len(payload)))
        assert reader().get(url, into, told.append) is into and bytes(into) == payload
        assert len(told) >= 4 and told == sorted(told) and told[-1] == len(payload), told
        assert all(b - a <= LANDED_STEP for a, b in zip([0, *told], told))


def test_a_kept_connection_the_server_closed_is_replaced_once(receiver):
    payload = body_of(5000)
    ports: list[int] = []

    def route(handler):  # answers, then closes without saying so: the client keeps a dead connection
        ports.append(handler.client_address[1])
        handler.close_connection = True
        return 200, {}, payload

    receiver.routes[("GET", "/o/b")] = route
    objects = reader()
    for _ in range(3):
        into = memoryview(bytearray(len(payload)))
        assert objects.get(f"{receiver.url}/o/b", into) is into and bytes(into) == payload
    assert len(set(ports)) == 3  # each GET after the first found its kept connection dead
    objects.close()


@pytest.mark.parametrize("status", [403, 404, 410])
def test_a_missing_or_expired_object_is_none(receiver, status):
    receiver.routes[("GET", "/o/c")] = lambda h: (status, {}, b"<Error>no</Error>")
    assert reader().get(f"{receiver.url}/o/c", memoryview(bytearray(10))) is None


def test_another_status_is_one_line(receiver):
    receiver.routes[("GET", "/o/d")] = lambda h: (500, {}, b"boom")
    with pytest.raises(KvcdnError, match=r"^GET of a chunk failed \(500\)$"):
        reader().get(f"{receiver.url}/o/d", memoryview(bytearray(10)))


def test_a_body_of_the_wrong_length_is_never_cut_or_padded(receiver):
    url = serve_bytes(receiver, "/o/e", b"x" * 120)
    got = reader().get(url, memoryview(bytearray(100)))
    assert isinstance(got, bytes) and got == b"x" * 120  # longer: as it came (the digest check refuses it)
    url = serve_bytes(receiver, "/o/f", b"y" * 80)
    assert reader().get(url, memoryview(bytearray(100))) == b"y" * 80  # shorter: the same

    def cut(handler):  # promises 1,000 bytes, sends 10 and hangs up
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        handler.wfile.write(b"z" * 10)
        handler.wfile.flush()
        handler.close_connection = True

    receiver.routes[("GET", "/o/g")] = cut
    with pytest.raises(KvcdnError, match=r"^a chunk's body ended early \(it declared 1000 bytes\)$"):
        reader().get(f"{receiver.url}/o/g", memoryview(bytearray(1000)))
    with pytest.raises(KvcdnError, match=r"^a chunk's body ended early \(it declared 1000 bytes\)$"):
        reader().get(f"{receiver.url}/o/g")


def test_a_connection_is_not_kept_after_a_refusal_a_close_or_the_readers_close(receiver):
    ports: list[int] = []

    def answer(status: int, headers: dict):
        def route(handler):
            ports.append(handler.client_address[1])
            return status, headers, b"z" * 100

        return route

    receiver.routes[("GET", "/o/m")] = answer(404, {})
    receiver.routes[("GET", "/o/n")] = answer(200, {"Connection": "close"})
    receiver.routes[("GET", "/o/o")] = answer(200, {})
    objects = reader()
    for path in ("/o/m", "/o/m", "/o/n", "/o/n"):
        objects.get(f"{receiver.url}{path}")
    assert len(set(ports)) == 4  # none of them reused
    objects.get(f"{receiver.url}/o/o")
    objects.close()
    objects.get(f"{receiver.url}/o/o")  # after close: a new connection, not kept either
    objects.get(f"{receiver.url}/o/o")
    assert len(set(ports[4:])) == 3


def test_a_server_that_does_not_answer_times_out(receiver):
    release = threading.Event()

    def stalled(handler):
        release.wait(30)
        return 200, {}, b"late"

    receiver.routes[("GET", "/o/p")] = stalled
    objects = ObjectReader(httpx.Client(), "kvcdn-test", timeout=0.2)
    try:
        with pytest.raises(TimeoutError):
            objects.get(f"{receiver.url}/o/p")
    finally:
        release.set()


def test_a_url_http_client_will_not_send_goes_through_httpx_and_no_error_repeats_it(receiver):
    receiver.routes[("GET", "/o/q")] = lambda h: (200, {}, b"ok")
    assert reader().get(f"{receiver.url}/o/q?X-Signature=SECRET 1") == b"ok"
    method, path, headers, _ = receiver.requests[-1]
    assert path == "/o/q?X-Signature=SECRET%201" and headers["User-Agent"].startswith("python-httpx")


def test_a_refused_connection_raises(receiver):
    port = receiver.server.server_address[1]
    receiver.close()
    with pytest.raises(ConnectionError):
        reader().get(f"http://127.0.0.1:{port}/o/h", memoryview(bytearray(10)))


def test_a_url_that_is_not_http_is_one_line():
    with pytest.raises(KvcdnError, match="not an http"):
        reader().get("file:///etc/passwd")


def test_a_proxy_in_the_environment_is_honoured(receiver, monkeypatch):
    """The proxy (here the receiver itself) gets the GET with the absolute URL, as a proxy does;
    NO_PROXY for the host sends it straight there, through httpx, which reads NO_PROXY."""
    payload = body_of(2000)
    target = "http://objects.invalid:9/o/i?sig=1"
    receiver.routes[("GET", target.split("?")[0])] = lambda h: (200, {}, payload)
    monkeypatch.setenv("HTTP_PROXY", receiver.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    objects = reader()
    into = memoryview(bytearray(len(payload)))
    assert objects.get(target, into) is into and bytes(into) == payload
    assert receiver.requests[-1][1] == target

    direct = serve_bytes(receiver, "/o/j", payload)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert reader().get(direct) == payload
    _, path, headers, _ = receiver.requests[-1]
    assert path == "/o/j?sig=abc"  # straight to the host, as httpx reads NO_PROXY: through httpx
    assert headers["User-Agent"].startswith("python-httpx")


def test_many_threads_each_get_their_own_bytes(receiver):
    objects = reader()
    urls = {i: serve_bytes(receiver, f"/o/k{i}", body_of(50_000 + i, seed=i)) for i in range(24)}

    def get(i: int) -> bool:
        into = memoryview(bytearray(50_000 + i))
        return objects.get(urls[i], into) is into and bytes(into) == body_of(50_000 + i, seed=i)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(get, list(urls) * 4))
    objects.close()


# -- TLS ----------------------------------------------------------------------------------------


def _certificates(directory) -> tuple[str, str, str]:
    """A CA and a server certificate for 127.0.0.1 signed by it: (CA file, cert file, key file)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("kvcdn test CA"))
        .issuer_name(name("kvcdn test CA"))
        .public_key(ca_key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(2)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    files = (directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
    files[0].write_bytes(ca.public_bytes(pem))
    files[1].write_bytes(cert.public_bytes(pem))
    files[2].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return tuple(str(f) for f in files)  # type: ignore[return-value]


@pytest.fixture
def tls_server(tmp_path):
    ca, cert, key = _certificates(tmp_path)
    payload = body_of(100_000)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        def handle_error(self, request, client_address):  # a client that refused the certificate
            pass

    server = Server(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{server.server_address[1]}/o/tls?sig=1", ca, payload
    server.shutdown()
    server.server_close()


def test_https_is_verified_against_the_roots_httpx_uses(tls_server, monkeypatch):
    url, ca, payload = tls_server
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with pytest.raises(ssl.SSLCertVerificationError):  # a CA no trusted root signed
        reader().get(url)
    monkeypatch.setenv("SSL_CERT_FILE", ca)  # as httpx honours it
    into = memoryview(bytearray(len(payload)))
    objects = reader()
    assert objects.get(url, into) is into and bytes(into) == payload
    assert objects.get(url) == payload
    objects.close()
