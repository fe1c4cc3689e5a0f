"""Server settings: one frozen dataclass per group, read from YAML (``server/config.yaml`` documents each key).

Unknown keys and wrong types are a :class:`ConfigError` naming the file, the key, the expected and the
received value, so a typo never silently falls back to a default.

``thoughtjax serve`` reads its settings here and nowhere else (:func:`serve_config`): a command-line flag wins
over a ``THOUGHTJAX_*`` environment variable (:data:`ENVIRONMENT`), which wins over the YAML file, which wins
over the built-in default (:data:`SERVE_DEFAULTS`: the OpenAI HTTP endpoint on :data:`DEFAULT_HTTP_PORT`; the
Python API's :class:`ServerConfig` keeps HTTP off unless asked, so servers made in tests and benchmarks never
contend for one fixed port).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from thoughtjax.defaults import DEFAULT_MAX_TOKENS
from thoughtjax.errors import UserError

DEFAULT_CONFIG = Path(__file__).with_name("config.yaml")
SCHEDULERS = ("continuous", "simple")
ENGINE_LAYOUTS = (None, "unrolled", "indexed")  # ServerConfig.engine_layout
WEIGHTS = ("f32", "native")  # ServerConfig.weights


class ConfigError(UserError, ValueError):
  """The server configuration cannot be used as given; the message names the key and the fix."""


@dataclasses.dataclass(frozen=True)
class TlsConfig:
  cert: Path | None = None
  key: Path | None = None
  client_ca: Path | None = None

  @property
  def enabled(self) -> bool:
    return self.cert is not None

  @property
  def mutual(self) -> bool:
    return self.client_ca is not None


@dataclasses.dataclass(frozen=True)
class KeepaliveConfig:
  time_ms: int = 60_000
  timeout_ms: int = 20_000
  permit_without_calls: bool = True
  min_client_ping_interval_ms: int = 100
  max_ping_strikes: int = 0


WARM_ALL = "all"  # warm.hints: every hint the registry calibrated (what a request without hints is routed to)
WARM_MODES = ("greedy", "sample", "sample_top_p")


@dataclasses.dataclass(frozen=True)
class WarmConfig:
  hints: tuple[str, ...] = ()  # WARM_ALL among them: every calibrated hint
  prompt_tokens: tuple[int, ...] = (16,)
  max_tokens: tuple[int, ...] = (DEFAULT_MAX_TOKENS,)
  # The plan each budget gets on a warm process is warmed: a tight one warms the faster path (the int8 full path)
  # that a tight budget or a busy server moves a request to, which a cold server would never choose.
  budgets_ms: tuple[float, ...] = (math.inf,)
  # The sampling modes a slot engine's programs are compiled in: greedy (temperature 0), sample (a temperature;
  # OpenAI's default), sample_top_p (top_p < 1). A mode not warmed compiles at its first request.
  modes: tuple[str, ...] = ("greedy",)

  def __post_init__(self):
    bad = [m for m in self.modes if m not in WARM_MODES]
    if bad or not self.modes:
      raise ConfigError(f"warm.modes: expected a non-empty list of {list(WARM_MODES)}, got {list(self.modes)!r}")

  @property
  def every_hint(self) -> bool:
    """Whether the hints name :data:`WARM_ALL`: warm every hint the registry calibrated."""
    return WARM_ALL in self.hints


_TOKEN_FILES: dict[Path, tuple[tuple[int, int, int], str]] = {}  # path -> (stat signature, secret read)


def _bearer(token: str | None, token_file: Path | None, where: str) -> str | None:
  """``token``, or the secret in ``token_file``: read again only when the file changed (its inode, size or mtime:
  a rotated file takes effect at the next call; an unchanged one costs a stat, not a read, on the event loop)."""
  if token_file is None:
    return token
  try:
    st = os.stat(token_file)
    signature = (st.st_ino, st.st_size, st.st_mtime_ns)
    cached = _TOKEN_FILES.get(token_file)
    if cached is not None and cached[0] == signature:
      return cached[1]
    token = token_file.read_text().strip()
  except OSError as e:
    _TOKEN_FILES.pop(token_file, None)
    raise ConfigError(f"{where}.token_file {token_file}: cannot read it ({e.strerror}); fix the path") from None
  if len(token) < 16:
    _TOKEN_FILES.pop(token_file, None)
    raise ConfigError(f"{where}.token_file {token_file}: expected a secret of at least 16 characters")
  _TOKEN_FILES[token_file] = (signature, token)
  return token


def _check_token(token, token_file, where: str) -> None:
  if token is not None and token_file is not None:
    raise ConfigError(f"{where}: set token or token_file, not both")
  if token is not None and (not isinstance(token, str) or len(token) < 16):
    raise ConfigError(f"{where}.token: expected a secret string of at least 16 characters; generate a long random one")


@dataclasses.dataclass(frozen=True)
class ClientsConfig:
  """The bearer every non-admin call carries (gRPC metadata ``authorization: Bearer ...``, HTTP header
  ``Authorization: Bearer ...``); ``token_file``: read from that file. Nothing set: clients need no token
  (with ``tls.client_ca`` they still need a certificate)."""

  token: str | None = None
  token_file: Path | None = None

  def __post_init__(self):
    _check_token(self.token, self.token_file, "clients")

  def bearer(self) -> str | None:
    return _bearer(self.token, self.token_file, "clients")


@dataclasses.dataclass(frozen=True)
class AdminConfig:
  """Who may call ReloadRegistry and RegistryStats: a client certificate identity (mTLS; a subject alternative
  name or the common name) in ``identities``, or the bearer ``token`` (metadata ``authorization: Bearer ...``;
  ``token_file``: read from that file). Nothing set: admin calls are refused unless ``open`` (a loopback
  development server). A reload is refused within ``reload_interval_s`` of the last one."""

  identities: tuple[str, ...] = ()
  token: str | None = None
  token_file: Path | None = None
  open: bool = False
  reload_interval_s: float = 10.0

  def __post_init__(self):
    _check_token(self.token, self.token_file, "admin")
    if not isinstance(self.open, bool):
      raise ConfigError(f"admin.open: expected true or false, got {self.open!r}")
    r = self.reload_interval_s
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0:
      raise ConfigError(f"admin.reload_interval_s: expected a finite number of seconds >= 0, got {r!r}")

  def bearer(self) -> str | None:
    """The configured token (read from ``token_file`` each call, so a rotated file takes effect)."""
    return _bearer(self.token, self.token_file, "admin")


@dataclasses.dataclass(frozen=True)
class PrefixCacheConfig:
  """Per slot engine (continuous scheduler), the prompt keys of recent prompts by token prefix, so a request that
  starts like an earlier one (system prompt, chat template rows, few-shot block, earlier turns) prefills only the
  rest: ``max_mb`` MiB at most (least recently used blocks evicted first; 0: off), in blocks of ``block_tokens``
  tokens (a prefix is reused in whole blocks). Requests share keys only within one ``cache_salt`` (none: the shared
  scope); ``report_reuse`` tells every request its reuse (Trace.prefix_cache_tokens, the trailer), which lets a
  client of the shared scope learn whether another sent a prefix: off by default, when only salted requests are
  told theirs."""

  max_mb: int = 128
  block_tokens: int = 16
  report_reuse: bool = False

  def __post_init__(self):
    if isinstance(self.max_mb, bool) or not isinstance(self.max_mb, int) or self.max_mb < 0:
      raise ConfigError(f"prefix_cache.max_mb: expected an integer >= 0 (MiB per engine; 0: off), got {self.max_mb!r}")
    b = self.block_tokens
    if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 1024:
      raise ConfigError(f"prefix_cache.block_tokens: expected an integer in [1, 1024] (16 suits most), got {b!r}")
    if not isinstance(self.report_reuse, bool):
      raise ConfigError(f"prefix_cache.report_reuse: expected true or false, got {self.report_reuse!r}")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  bind: str = "127.0.0.1"
  port: int = 50051
  tls: TlsConfig = TlsConfig()
  keepalive: KeepaliveConfig = KeepaliveConfig()
  max_message_bytes: int = 4 * 1024 * 1024
  # Open gRPC connections at most (the HTTP front's are counted apart, http_max_connections); one more is closed at
  # once, before its handshake. A connection that has not finished its HTTP/2 handshake (the client's preface and
  # settings) this long after it opened is sent GOAWAY and closed.
  grpc_max_connections: int = 512
  grpc_handshake_timeout_s: float = 15.0
  max_concurrent: int = 16
  max_queue: int = 64
  # A request's checks (tokenizing its prompt, compiling its constraint) not done this long after they were handed to
  # the check workers: RESOURCE_EXHAUSTED; the check is dropped if it has not started, else its result discarded.
  validation_timeout_s: float = 10.0
  max_tokens_limit: int = 2048
  # A request without max_tokens (HTTP, OpenAI's default) generates until the end of text or until its prompt and
  # output fill this many tokens (doubled until the prompt + 64 new tokens fit), as a llama-server slot's context
  # bounds it: such a request joins the engine its path already runs instead of making one with a ring for
  # max_tokens_limit, which every later request would decode over. None: the model's context bounds it.
  until_eos_tokens: int | None = 512
  grace_s: float = 30.0
  warm: WarmConfig = WarmConfig()
  metrics_port: int | None = None  # Prometheus /metrics; None: off, 0: any free port
  metrics_bind: str = "127.0.0.1"
  scheduler: str = "continuous"  # "continuous" (slot engines, server/scheduling.py) or "simple" (one generation each)
  # Continuous: how the slot engines' programs run a path's blocks. "indexed": one loop over the stacked layer
  # weights (thoughtjax.decode.indexed), which compiles and warms in a fraction of the time into less memory; None:
  # the model's own layout (a registry path's: unrolled), which decodes a wide float32 batch faster (BENCHMARKS.md);
  # a path with a bridge always runs unrolled.
  engine_layout: str | None = "indexed"
  # The form the registry's restores take: "native" (a quantized model's blocks kept packed, computed in float32:
  # the same logits, fewer bytes per step) or "f32" (dequantized float32). Weight variants (@int8) are paths.
  # Native and indexed together served the peer benchmark 1.1-2.8x faster than f32 and the model's own layout, ready
  # in 56 s against 265 s, at 0.66x the peak RSS (BENCHMARKS.md).
  weights: str = "native"
  admin: AdminConfig = AdminConfig()
  clients: ClientsConfig = ClientsConfig()
  http_port: int | None = None  # OpenAI-compatible HTTP (server/http.py) on ``bind``; None: off, 0: any free port
  http_max_body_bytes: int = 1024 * 1024  # a larger request body is refused (413) before it is parsed
  # Open HTTP connections at most; one more is answered 503 and closed before anything of it is read.
  http_max_connections: int = 256
  # A connection that has not sent a whole request head this long after it opened (or after its last response) is
  # closed: idle keep-alive and half-open or slowly written heads alike.
  http_idle_timeout_s: float = 15.0
  http_body_timeout_s: float = 30.0  # a request body not received whole this long after its head: 408, closed
  # A streamed answer whose next event the client has not taken this long (it stopped reading, and the socket's
  # buffers are full) ends: the connection is reset, the request's turn and slot are freed.
  http_write_timeout_s: float = 30.0
  # Without a client token, the HTTP front answers only requests whose Host is a loopback name, the bind address or
  # one of these (a web page that rebinds its DNS name to this machine must not reach a tokenless server).
  http_allowed_hosts: tuple[str, ...] = ()
  model_name: str | None = None  # the model id /v1/models lists and requests name; None: the registry's folder
  strict_fields: bool = False  # HTTP: an unknown body field is a 400 (False: ignored, with a logged warning)
  max_stop_strings: int = 16  # stop strings per request
  max_stop_chars: int = 256  # characters per stop string
  max_path_layers: int | None = None  # pieces and layers of an explicit path; None: twice the model's layers
  prefix_cache: PrefixCacheConfig = PrefixCacheConfig()
  # ---- idle release (scale to zero) ----
  idle_release_s: float | None = 300.0  # a path idle this long drops its engines and weights; None or 0: never
  idle_release_programs: bool = False  # once no path is resident, compiled programs go too (come-back compiles)

  def __post_init__(self):
    if self.scheduler not in SCHEDULERS:
      raise ConfigError(f"scheduler: expected one of {list(SCHEDULERS)}, got {self.scheduler!r}")
    if self.until_eos_tokens is not None:
      _positive_int(self.until_eos_tokens, "until_eos_tokens")
    if self.engine_layout not in ENGINE_LAYOUTS:
      raise ConfigError(f"engine_layout: expected one of {list(ENGINE_LAYOUTS)}, got {self.engine_layout!r}")
    if self.weights not in WEIGHTS:
      raise ConfigError(f"weights: expected one of {list(WEIGHTS)}, got {self.weights!r}")
    for name in (
      "max_message_bytes",
      "max_concurrent",
      "max_tokens_limit",
      "max_stop_strings",
      "max_stop_chars",
      "http_max_body_bytes",
      "http_max_connections",
      "grpc_max_connections",
    ):
      _positive_int(getattr(self, name), name)
    for name in (
      "http_idle_timeout_s",
      "http_body_timeout_s",
      "http_write_timeout_s",
      "grpc_handshake_timeout_s",
      "validation_timeout_s",
    ):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{name}: expected a finite number of seconds > 0, got {v!r}")
    hosts = self.http_allowed_hosts
    if (
      isinstance(hosts, str) or not isinstance(hosts, (list, tuple)) or not all(isinstance(h, str) and h for h in hosts)
    ):
      raise ConfigError(f"http_allowed_hosts: expected a list of host names (no port), got {hosts!r}")
    object.__setattr__(self, "http_allowed_hosts", tuple(h.strip().lower().strip("[]") for h in hosts))
    if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
      raise ConfigError(f"max_queue: expected an integer >= 0, got {self.max_queue!r}")
    if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
      raise ConfigError(f"port: expected an integer in [0, 65535] (0: any free port), got {self.port!r}")
    if self.metrics_port is not None and (
      isinstance(self.metrics_port, bool)
      or not isinstance(self.metrics_port, int)
      or not 0 <= self.metrics_port < 65536
    ):
      raise ConfigError(
        f"metrics_port: expected null (no metrics endpoint) or an integer in [0, 65535] (0: any free port), "
        f"got {self.metrics_port!r}"
      )
    if self.http_port is not None and (
      isinstance(self.http_port, bool) or not isinstance(self.http_port, int) or not 0 <= self.http_port < 65536
    ):
      raise ConfigError(
        f"http_port: expected null (no HTTP endpoint) or an integer in [0, 65535] (0: any free port), "
        f"got {self.http_port!r}"
      )
    if self.model_name is not None and (not isinstance(self.model_name, str) or not self.model_name.strip()):
      raise ConfigError(
        f"model_name: expected a non-empty model id or null (the registry's folder name), got {self.model_name!r}"
      )
    if not isinstance(self.strict_fields, bool):
      raise ConfigError(f"strict_fields: expected true or false, got {self.strict_fields!r}")
    if self.max_path_layers is not None:
      _positive_int(self.max_path_layers, "max_path_layers")
    _check_idle_release(self.idle_release_s)
    if not isinstance(self.idle_release_programs, bool):
      raise ConfigError(f"idle_release_programs: expected true or false, got {self.idle_release_programs!r}")
    if not isinstance(self.metrics_bind, str) or not self.metrics_bind:
      raise ConfigError(f"metrics_bind: expected an address such as 127.0.0.1, got {self.metrics_bind!r}")
    if not isinstance(self.grace_s, (int, float)) or not math.isfinite(self.grace_s) or self.grace_s < 0:
      raise ConfigError(f"grace_s: expected a finite number of seconds >= 0, got {self.grace_s!r}")
    if (self.tls.cert is None) != (self.tls.key is None):
      raise ConfigError(
        f"tls: cert and key go together, got cert={self.tls.cert} key={self.tls.key}; set both "
        f"(TLS) or neither (plaintext)"
      )
    if self.tls.client_ca is not None and self.tls.cert is None:
      raise ConfigError("tls.client_ca (mTLS) needs tls.cert and tls.key too: clients verify the server as well")

  @property
  def idle_release(self) -> float | None:
    """Seconds after which an idle path is released; None: never."""
    return None if not self.idle_release_s else float(self.idle_release_s)

  @property
  def address(self) -> str:
    host = f"[{self.bind}]" if ":" in self.bind and not self.bind.startswith("[") else self.bind
    return f"{host}:{self.port}"

  def grpc_options(self) -> list[tuple[str, Any]]:
    """Channel arguments of the server: message limits, the connection cap and handshake timeout, and keepalive
    that tolerates pinging clients."""
    k = self.keepalive
    return [
      ("grpc.max_allowed_incoming_connections", self.grpc_max_connections),
      ("grpc.server_handshake_timeout_ms", round(self.grpc_handshake_timeout_s * 1000)),
      ("grpc.max_receive_message_length", self.max_message_bytes),
      ("grpc.max_send_message_length", self.max_message_bytes),
      ("grpc.keepalive_time_ms", k.time_ms),
      ("grpc.keepalive_timeout_ms", k.timeout_ms),
      ("grpc.keepalive_permit_without_calls", int(k.permit_without_calls)),
      # Without these two a client pinging more often than every 5 minutes gets GOAWAY too_many_pings.
      ("grpc.http2.min_recv_ping_interval_without_data_ms", k.min_client_ping_interval_ms),
      ("grpc.http2.min_ping_interval_without_data_ms", k.min_client_ping_interval_ms),
      ("grpc.http2.max_ping_strikes", k.max_ping_strikes),
      ("grpc.http2.max_pings_without_data", 0),
    ]

  def replace(self, **changes) -> ServerConfig:
    return dataclasses.replace(self, **changes)


def _check_idle_release(v) -> None:
  """``idle_release_s``: null or 0 (never release), or a finite number of seconds > 0."""
  if v is None:
    return
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
    raise ConfigError(
      f"idle_release_s: expected a finite number of seconds >= 0 (0 or null: never release an idle path), "
      f"got {v!r}; e.g. 300"
    )


def _positive_int(v, name: str) -> None:
  if isinstance(v, bool) or not isinstance(v, int) or v < 1:
    raise ConfigError(f"{name}: expected an integer >= 1, got {v!r}")


def _section(cls, data: Any, where: str, convert: Mapping[str, Any] | None = None):
  if data is None:
    return cls()
  if not isinstance(data, Mapping):
    raise ConfigError(f"{where}: expected a mapping of {[f.name for f in dataclasses.fields(cls)]}, got {data!r}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - set(fields))
  if unknown:
    raise ConfigError(f"{where}: unknown keys {unknown}; known keys: {sorted(fields)}")
  out = {}
  for key, value in data.items():
    conv = (convert or {}).get(key)
    out[key] = conv(value, f"{where}.{key}") if conv else value
  return cls(**out)


def _path(base: Path):
  def conv(v, where):
    if v is None:
      return None
    if not isinstance(v, (str, os.PathLike)):
      raise ConfigError(f"{where}: expected a file path or null, got {v!r}")
    p = Path(v).expanduser()
    return p if p.is_absolute() else base / p

  return conv


def _ints(v, where):
  if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v):
    raise ConfigError(f"{where}: expected a list of positive integers, got {v!r}")
  return tuple(v)


def _budgets(v, where):
  ok = isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
  if not ok or not all(x > 0 for x in v):
    raise ConfigError(f"{where}: expected a non-empty list of budgets in ms > 0 (.inf: none), got {v!r}")
  return tuple(float(x) for x in v)


def _strs(v, where):
  if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
    raise ConfigError(f"{where}: expected a list of hint names, got {v!r}")
  return tuple(v)


def _names(v, where):
  if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x for x in v):
    raise ConfigError(f"{where}: expected a list of client certificate identities (names), got {v!r}")
  return tuple(v)


def _number(v, where):
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise ConfigError(f"{where}: expected a number, got {v!r}")
  return float(v)


def _int(v, where):
  if isinstance(v, bool) or not isinstance(v, int):
    raise ConfigError(f"{where}: expected an integer, got {v!r}")
  return v


def from_mapping(data: Mapping | None, where: str = "server config", base: Path | None = None) -> ServerConfig:
  """A :class:`ServerConfig` from a parsed YAML mapping; relative TLS paths are taken from ``base``."""
  base = base or Path.cwd()
  data = dict(data or {})
  tls = _section(
    TlsConfig, data.pop("tls", None), f"{where}: tls", {k: _path(base) for k in ("cert", "key", "client_ca")}
  )
  keep = _section(
    KeepaliveConfig,
    data.pop("keepalive", None),
    f"{where}: keepalive",
    {"time_ms": _int, "timeout_ms": _int, "min_client_ping_interval_ms": _int, "max_ping_strikes": _int},
  )
  warm = _section(
    WarmConfig,
    data.pop("warm", None),
    f"{where}: warm",
    {"hints": _strs, "prompt_tokens": _ints, "max_tokens": _ints, "budgets_ms": _budgets, "modes": _strs},
  )
  admin = _section(
    AdminConfig,
    data.pop("admin", None),
    f"{where}: admin",
    {"identities": _names, "token_file": _path(base), "reload_interval_s": _number},
  )
  clients = _section(ClientsConfig, data.pop("clients", None), f"{where}: clients", {"token_file": _path(base)})
  prefix = _section(PrefixCacheConfig, data.pop("prefix_cache", None), f"{where}: prefix_cache")
  top = _section(ServerConfig, data, where)
  return dataclasses.replace(top, tls=tls, keepalive=keep, warm=warm, admin=admin, clients=clients, prefix_cache=prefix)


def load_config(path: str | os.PathLike | None = None) -> ServerConfig:
  """The settings in ``path`` (default: the shipped ``server/config.yaml``)."""

  path, data = _read_yaml(path)
  return from_mapping(data, f"server config {path}", path.parent)


def _read_yaml(path: str | os.PathLike | None) -> tuple[Path, dict]:
  path = Path(path) if path is not None else DEFAULT_CONFIG
  try:
    data = yaml.safe_load(path.read_text())
  except FileNotFoundError:
    raise ConfigError(f"server config {path}: no such file; pass an existing --config or omit it") from None
  except yaml.YAMLError as e:
    raise ConfigError(f"server config {path}: not valid YAML ({e}); fix the file") from None
  if data is not None and not isinstance(data, Mapping):
    raise ConfigError(f"server config {path}: expected a mapping of settings, got {type(data).__name__}")
  return path, dict(data or {})


# ---- thoughtjax serve: flags > environment > YAML > built-in defaults ----------------------------------------
DEFAULT_HTTP_PORT = 8080  # llama-server's port; gRPC beside it on ServerConfig.port (50051)
# What `thoughtjax serve` uses where its YAML file does not set the key (``http_port: null`` in the file: off).
SERVE_DEFAULTS: dict[str, Any] = {"http_port": DEFAULT_HTTP_PORT}
# Environment variable -> the setting it gives (dotted: a key of a section), below flags and above the YAML file.
ENVIRONMENT = {
  "THOUGHTJAX_API_KEY": "clients.token",
  "THOUGHTJAX_MODEL_ALIAS": "model_name",
  "THOUGHTJAX_SLOTS": "max_concurrent",
  "THOUGHTJAX_WARM": "warm.hints",
  "THOUGHTJAX_ENGINE_LAYOUT": "engine_layout",
  "THOUGHTJAX_WEIGHTS": "weights",
}
# Setting -> the flag of `thoughtjax serve` that gives it, for errors that name what the user typed.
FLAGS = {
  "clients.token": "--api-key",
  "model_name": "--alias/--served-model-name",
  "max_concurrent": "--parallel/-np/--slots",
  "warm.hints": "--warm",
  "weights": "--weights",
}


def _from_text(key: str, value: str, source: str) -> Any:
  """An environment variable's or flag's text as the value of setting ``key``; a :class:`ConfigError` naming
  ``source`` (the variable or the flag) when it cannot be one."""
  text = value.strip()
  if key == "max_concurrent":
    try:
      n = int(text)
    except ValueError:
      n = 0
    if n < 1:
      raise ConfigError(f"{source}: expected the number of slots, an integer >= 1, got {value!r}; e.g. 4")
    return n
  if key == "warm.hints":
    hints = [h.strip() for h in text.split(",")]
    if not text or not all(hints):
      raise ConfigError(f"{source}: expected hint names separated by commas, got {value!r}; e.g. general_purpose")
    return hints
  if key == "engine_layout" and text not in ENGINE_LAYOUTS:
    raise ConfigError(f"{source}: expected one of {', '.join(ENGINE_LAYOUTS[1:])}, got {value!r}")
  if key == "weights" and text not in WEIGHTS:
    raise ConfigError(f"{source}: expected one of {', '.join(WEIGHTS)}, got {value!r}")
  if key == "clients.token" and len(text) < 16:
    raise ConfigError(
      f"{source}: expected a client token of at least 16 characters, got {len(text)}; generate a long random one "
      f"(e.g. `openssl rand -hex 24`)"
    )
  if not text:
    raise ConfigError(f"{source}: expected a non-empty value, got {value!r}; unset it to take the config's")
  return text


def _put(data: dict, key: str, value: Any) -> None:
  """Set the dotted ``key`` of the raw settings ``data``; a client token replaces a configured token file."""
  if "." not in key:
    data[key] = value
    return
  section, name = key.split(".", 1)
  inner = data.get(section)
  inner = dict(inner) if isinstance(inner, Mapping) else {}
  inner[name] = value
  if key == "clients.token":
    inner["token_file"] = None
  data[section] = inner


def serve_config(
  path: str | os.PathLike | None = None,
  flags: Mapping[str, Any] | None = None,
  environ: Mapping[str, str] | None = None,
  defaults: Mapping[str, Any] | None = None,
) -> ServerConfig:
  """The settings of ``thoughtjax serve``: ``flags`` (setting -> value, dotted for a section's key; a value of
  None is a flag not given, except ``http_port`` from ``--no-http``, which the caller passes as ``"off"``) over
  the :data:`ENVIRONMENT` variables of ``environ`` (default ``os.environ``; unset or empty: not given) over the
  YAML file ``path`` (default: the shipped one) over :data:`SERVE_DEFAULTS` and ``defaults`` (a key the file
  leaves out or sets to null; ``http_port: null`` is kept: HTTP off)."""
  path, data = _read_yaml(path)
  where = f"server config {path}"
  for key, value in {**SERVE_DEFAULTS, **(defaults or {})}.items():
    if key == "http_port":
      data.setdefault(key, value)
    elif data.get(key) is None:
      data[key] = value
  environ = os.environ if environ is None else environ
  for var, key in ENVIRONMENT.items():
    if environ.get(var):
      _put(data, key, _from_text(key, environ[var], var))
  for key, value in (flags or {}).items():
    if value is None:
      continue
    if key == "http_port" and value == "off":
      value = None
    elif isinstance(value, str) and key in FLAGS:
      value = _from_text(key, value, FLAGS[key])
    _put(data, key, value)
  return from_mapping(data, where, path.parent)
