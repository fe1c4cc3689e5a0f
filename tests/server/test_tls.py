"""TLS and mTLS by config, with certificates made in the test: a client that does not trust the server's CA,
or (mTLS) brings no certificate, is refused; one with the right credentials is served."""

from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.server.conftest import config, wait_ready
from thoughtjax.client import Client, ClientError
from thoughtjax.server.app import BackgroundServer
from thoughtjax.server.config import AdminConfig, TlsConfig


def _name(cn: str) -> x509.Name:
  return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool = False, server: bool = False):
  now = datetime.datetime.now(datetime.UTC)
  b = (
    x509.CertificateBuilder()
    .subject_name(_name(subject))
    .issuer_name(issuer_name)
    .public_key(key.public_key())
    .serial_number(x509.random_serial_number())
    .not_valid_before(now - datetime.timedelta(minutes=5))
    .not_valid_after(now + datetime.timedelta(days=1))
    .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
  )
  if server:
    b = b.add_extension(
      x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
    )
  return b.sign(issuer_key, hashes.SHA256())


def _pem_key(k) -> bytes:
  return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _pem(c) -> bytes:
  return c.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
  d = tmp_path_factory.mktemp("pki")
  out = {}
  for ca_name in ("ca", "other_ca"):
    k = ec.generate_private_key(ec.SECP256R1())
    out[ca_name] = (k, _cert(ca_name, k, _name(ca_name), k, ca=True))
  ca_key, ca = out["ca"]
  for who, server in (("server", True), ("client", False), ("operator", False)):
    k = ec.generate_private_key(ec.SECP256R1())
    (d / f"{who}.key").write_bytes(_pem_key(k))
    (d / f"{who}.pem").write_bytes(_pem(_cert(who, k, ca.subject, ca_key, server=server)))
  other_key, other = out["other_ca"]
  k = ec.generate_private_key(ec.SECP256R1())
  (d / "stranger.key").write_bytes(_pem_key(k))
  (d / "stranger.pem").write_bytes(_pem(_cert("stranger", k, other.subject, other_key)))
  (d / "ca.pem").write_bytes(_pem(ca))
  (d / "other_ca.pem").write_bytes(_pem(other))
  return d


def _health(port, **creds) -> str:
  with Client(f"localhost:{port}", timeout=20, **creds) as c:
    return c.health()


def test_tls_serves_a_client_that_trusts_the_ca_and_refuses_others(synthesizer, pki):
  tls = TlsConfig(cert=pki / "server.pem", key=pki / "server.key")
  with BackgroundServer(synthesizer, config(bind="127.0.0.1", tls=tls)) as srv:
    wait_ready(srv)
    assert _health(srv.port, ca=pki / "ca.pem") == "SERVING"
    with pytest.raises(ClientError) as e:
      _health(srv.port, ca=pki / "other_ca.pem")  # does not trust this server
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ClientError) as e:
      _health(srv.port)  # plaintext against a TLS port
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_mtls_requires_a_client_certificate_signed_by_the_client_ca(synthesizer, pki):
  tls = TlsConfig(cert=pki / "server.pem", key=pki / "server.key", client_ca=pki / "ca.pem")
  with BackgroundServer(synthesizer, config(tls=tls)) as srv:
    wait_ready(srv)
    assert _health(srv.port, ca=pki / "ca.pem", cert=pki / "client.pem", key=pki / "client.key") == "SERVING"
    for creds in (
      {"ca": pki / "ca.pem"},
      {"ca": pki / "ca.pem", "cert": pki / "stranger.pem", "key": pki / "stranger.key"},
    ):
      with pytest.raises(ClientError) as e:
        _health(srv.port, **creds)
      assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_admin_calls_take_an_allowed_client_certificate_or_the_token(synthesizer, pki):
  tls = TlsConfig(cert=pki / "server.pem", key=pki / "server.key", client_ca=pki / "ca.pem")
  token = "a-long-admin-token-for-the-test"
  admin = AdminConfig(identities=("operator",), token=token, reload_interval_s=0)
  with BackgroundServer(synthesizer, config(tls=tls, admin=admin)) as srv:
    wait_ready(srv)
    target, ca = f"localhost:{srv.port}", pki / "ca.pem"
    with Client(target, timeout=60, ca=ca, cert=pki / "operator.pem", key=pki / "operator.key") as c:
      assert c.registry_stats().registry_sequence >= 1 and c.reload_registry().switched is False
    with Client(target, timeout=60, ca=ca, cert=pki / "client.pem", key=pki / "client.key") as c:
      for method in (c.registry_stats, c.reload_registry):  # signed by the client CA, not an admin
        with pytest.raises(ClientError) as e:
          method()
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "admin.identities" in e.value.details
      assert c.generate("The quick brown fox", max_tokens=2).usage.tokens_out >= 1  # still served
    with Client(target, timeout=60, ca=ca, cert=pki / "client.pem", key=pki / "client.key", token=token) as c:
      assert c.registry_stats().registry_sequence >= 1


def test_unreadable_or_non_pem_tls_files_are_named(synthesizer, pki, tmp_path):
  from thoughtjax.server.config import ConfigError

  (tmp_path / "junk.pem").write_text("not a certificate")
  for tls, match in (
    (TlsConfig(cert=tmp_path / "missing.pem", key=pki / "server.key"), "tls.cert .*cannot read"),
    (TlsConfig(cert=tmp_path / "junk.pem", key=pki / "server.key"), "tls.cert .*expected PEM"),
  ):
    with pytest.raises(ConfigError, match=match):
      with BackgroundServer(synthesizer, config(tls=tls)):
        pass


def test_the_http_endpoint_takes_the_same_tls_and_client_certificates(synthesizer, pki):
  """The OpenAI-compatible endpoint is never a plaintext way around mTLS: HTTPS with the server's certificate,
  and a client certificate signed by the client CA, or no answer."""
  import ssl

  import openai

  tls = TlsConfig(cert=pki / "server.pem", key=pki / "server.key", client_ca=pki / "ca.pem")

  def models(port, scheme="https", cert=None):
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if cert is not None:
      ctx.load_cert_chain(pki / f"{cert}.pem", pki / f"{cert}.key")
    with openai.DefaultHttpxClient(verify=ctx, timeout=60) as h:  # the client's own HTTP library
      oa = openai.OpenAI(base_url=f"{scheme}://localhost:{port}/v1", api_key="unused", http_client=h, max_retries=0)
      return [m.id for m in oa.models.list().data]

  with BackgroundServer(synthesizer, config(tls=tls, http_port=0)) as srv:
    wait_ready(srv)
    port = srv.app.http_port
    assert models(port, cert="client") == [srv.app.http.model_id()]
    for kw in ({}, {"cert": "stranger"}, {"scheme": "http", "cert": "client"}):
      with pytest.raises(openai.APIConnectionError):
        models(port, **kw)
    assert models(port, cert="client")  # still serves
