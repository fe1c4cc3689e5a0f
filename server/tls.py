"""Server credentials: TLS from a certificate and key, mTLS when a client CA is configured (client
certificates then required), for gRPC (:func:`server_credentials`) and for the HTTP endpoint (:func:`ssl_context`).
Unreadable files are a :class:`~thoughtjax.server.config.ConfigError` naming the key."""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from thoughtjax.server.config import ConfigError, TlsConfig


def _read(path: Path, key: str) -> bytes:
  try:
    data = path.read_bytes()
  except OSError as e:
    raise ConfigError(f"tls.{key} {path}: cannot read it ({e.strerror}); point tls.{key} at a PEM file") from None
  if b"-----BEGIN" not in data:
    raise ConfigError(f"tls.{key} {path}: expected PEM (-----BEGIN ...), got {len(data)} bytes of something else")
  return data


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
  """The credentials of ``tls`` (None: plaintext)."""
  if not tls.enabled:
    return None
  pair = (_read(tls.key, "key"), _read(tls.cert, "cert"))
  ca = _read(tls.client_ca, "client_ca") if tls.mutual else None
  return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=tls.mutual)


def ssl_context(tls: TlsConfig) -> ssl.SSLContext | None:
  """The HTTP endpoint's TLS from the gRPC server's ``tls`` settings (client certificates required when
  ``client_ca`` is set), so the endpoint is never a plaintext way around them. None: plaintext."""
  if not tls.enabled:
    return None
  _read(tls.cert, "cert"), _read(tls.key, "key")  # a readable PEM each, or the ConfigError naming the key
  ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
  ctx.load_cert_chain(tls.cert, tls.key)
  if tls.mutual:
    _read(tls.client_ca, "client_ca")
    ctx.load_verify_locations(tls.client_ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
  return ctx
