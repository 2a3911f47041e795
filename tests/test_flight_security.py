"""The Flight front's gates: bearer tokens (none, wrong, right), TLS (a plaintext client refused, a
client that does not trust the server refused) and client certificates (a client without one
refused). Certificates are made in the test with the ``openssl`` command (skipped without it)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pyarrow as pa
import pytest

import arrow_ipc_bridge as aib

flight = pytest.importorskip("pyarrow.flight")
from arrow_ipc_bridge.flight import bearer_header, call_options, serve  # noqa: E402

TOKEN = "t0ken-for-the-tests-only-0123456789"


@pytest.fixture
def published(publisher: aib.Publisher) -> aib.Publisher:
    publisher.publish("t", pa.table({"x": [1, 2, 3]}))
    return publisher


def test_calls_without_the_right_token_are_refused(published: aib.Publisher) -> None:
    with serve(published, tokens=[TOKEN]) as front, flight.connect(front.location) as client:
        with pytest.raises(flight.FlightUnauthenticatedError, match="needs a bearer token"):
            list(client.list_flights())
        with pytest.raises(flight.FlightUnauthenticatedError, match="unknown token"):
            client.do_get(flight.Ticket(b"t"), options=call_options("x" * 40)).read_all()
        basic = flight.FlightCallOptions(headers=[(b"authorization", b"Basic dXNlcjpwYXNz")])
        with pytest.raises(flight.FlightUnauthenticatedError, match="not 'Bearer <token>'"):
            list(client.list_flights(options=basic))
        # A plain pyarrow client with the header reads everything.
        options = flight.FlightCallOptions(headers=[bearer_header(TOKEN)])
        assert [i.descriptor.path[0] for i in client.list_flights(options=options)] == [b"t"]
        assert client.do_get(flight.Ticket(b"t"), options=options).read_all().num_rows == 3


def test_any_of_several_tokens_is_admitted(published: aib.Publisher) -> None:
    other = "another-token-of-the-tests-987654"
    with serve(published, tokens=[TOKEN, other]) as front, flight.connect(front.location) as client:
        for token in (TOKEN, other):
            assert client.do_get(flight.Ticket(b"t"), options=call_options(token)).read_all().num_rows == 3


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A CA, a server certificate for localhost / 127.0.0.1 and a client certificate, all signed by it."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: cannot make test certificates")
    d = str(tmp_path_factory.mktemp("certs"))
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=aib-test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)  # fmt: skip
    with open(os.path.join(d, "san.cnf"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for who in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}", "-keyout", f"{who}.key",
                 "-out", f"{who}.csr", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", "san.cnf", "-out", f"{who}.pem", cwd=d)  # fmt: skip
    out = {}
    for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key"):
        with open(os.path.join(d, name), "rb") as f:
            out[name] = f.read()
    return out


def test_tls_serves_trusting_clients_and_refuses_plaintext(
    published: aib.Publisher, certs: dict[str, bytes]
) -> None:
    with serve(
        published,
        "grpc+tls://127.0.0.1:0",
        tokens=[TOKEN],
        tls_certificates=[(certs["server.pem"], certs["server.key"])],
    ) as front:
        assert front.location.startswith("grpc+tls://127.0.0.1:")
        with flight.connect(front.location, tls_root_certs=certs["ca.pem"]) as client:
            assert client.do_get(flight.Ticket(b"t"), options=call_options(TOKEN)).read_all().num_rows == 3
        plain = front.location.replace("grpc+tls://", "grpc://")
        with flight.connect(plain) as client, pytest.raises(flight.FlightUnavailableError):
            list(client.list_flights(options=call_options(TOKEN, timeout=5)))
        # A client that does not trust the server's CA does not talk to it.
        with flight.connect(front.location) as client, pytest.raises(flight.FlightUnavailableError):
            list(client.list_flights(options=call_options(TOKEN, timeout=5)))


def test_client_certificates_are_required_when_asked_for(
    published: aib.Publisher, certs: dict[str, bytes]
) -> None:
    with serve(
        published,
        "grpc+tls://127.0.0.1:0",
        tls_certificates=[(certs["server.pem"], certs["server.key"])],
        verify_client=True,
        root_certificates=certs["ca.pem"],
    ) as front:
        with flight.connect(
            front.location,
            tls_root_certs=certs["ca.pem"],
            cert_chain=certs["client.pem"],
            private_key=certs["client.key"],
        ) as client:
            assert client.do_get(flight.Ticket(b"t")).read_all().num_rows == 3
        with (
            flight.connect(front.location, tls_root_certs=certs["ca.pem"]) as client,
            pytest.raises(flight.FlightUnavailableError),
        ):
            list(client.list_flights(options=call_options(None, timeout=5)))


def test_two_authorization_headers_are_refused_as_two(published: aib.Publisher) -> None:
    """A call carrying two ``authorization`` headers is refused, and the message says that two came
    (not that the token is missing, which would send the user looking for a header they did send);
    one header of the same token is admitted."""
    with serve(published, tokens=[TOKEN]) as front, flight.connect(front.location) as client:
        two = flight.FlightCallOptions(headers=[bearer_header(TOKEN), bearer_header(TOKEN)])
        with pytest.raises(flight.FlightUnauthenticatedError) as refused:
            list(client.list_flights(options=two))
        message = str(refused.value)
        assert "2 authorization headers" in message
        assert "needs a bearer token" not in message
        one = flight.FlightCallOptions(headers=[bearer_header(TOKEN)])
        assert client.do_get(flight.Ticket(b"t"), options=one).read_all().num_rows == 3
