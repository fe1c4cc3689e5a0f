"""The deployment files of ``server/deploy/``: each parses, and they agree with one another and with the server.

The ConfigMap's ``config.yaml`` goes through the server's own loader (:func:`thoughtjax.server.config.load_config`) and the
container's arguments through the command line's own parser, so the ports checked are the ones ``thoughtjax serve``
would bind. :func:`problems` lists every disagreement, and every way the files fall short of their hardening (the
"restricted" Pod Security Standard, the NetworkPolicy, the client token from a Secret, Envoy's timeouts and limits);
the mutation tests show each kind of mistake is caught.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from thoughtjax.cachedir import UnsafeCacheError, private_dir
from thoughtjax.server.config import ENVIRONMENT, ConfigError, ServerConfig, load_config
from thoughtjax.server.http import CHAT, COMPLETIONS, HEALTH
from thoughtjax.server.servicer import SERVICE

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "server" / "deploy" / "kubernetes"
ENVOY = ROOT / "server" / "deploy" / "envoy" / "envoy.yaml"
KUSTOMIZATION = KUBE / "kustomization.yaml"
HEADLESS, HTTP_SERVICE, CONFIGMAP, DEPLOYMENT = (
  "thoughtjax-headless",
  "thoughtjax-http",
  "thoughtjax-config",
  "thoughtjax",
)
HTTP2 = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
SAFE_RETRIES = {"unavailable", "connect-failure", "refused-stream", "retriable-status-codes"}
ENVOY_PODS = {"app.kubernetes.io/name": "thoughtjax-envoy"}  # the label networkpolicy.yaml and envoy.yaml name
HCM = "envoy.filters.network.http_connection_manager"
CONNECTION_LIMIT = "envoy.filters.network.connection_limit"
GLOBAL_CONNECTIONS = "envoy.resource_monitors.global_downstream_max_connections"
# The "restricted" Pod Security Standard's volume types (every other one, hostPath first, is refused).
RESTRICTED_VOLUMES = {
  "configMap",
  "csi",
  "downwardAPI",
  "emptyDir",
  "ephemeral",
  "persistentVolumeClaim",
  "projected",
  "secret",
}


# ------------------------------------------------------------------------------ loading
def manifests() -> list[dict]:
  """Every object of the files the kustomization lists, in its order."""
  kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
  docs = []
  for name in kustomization["resources"]:
    docs.extend(d for d in yaml.safe_load_all((KUBE / name).read_text()) if d is not None)
  return docs


def envoy() -> dict:
  return yaml.safe_load(ENVOY.read_text())


def find(docs: list[dict], kind: str, name: str) -> dict:
  found = [d for d in docs if d.get("kind") == kind and d.get("metadata", {}).get("name") == name]
  if len(found) != 1:
    raise LookupError(f"expected one {kind} named {name}, found {len(found)}")
  return found[0]


def container(docs: list[dict]) -> dict:
  (c,) = [c for c in find(docs, "Deployment", DEPLOYMENT)["spec"]["template"]["spec"]["containers"]]
  return c


def served_config(docs: list[dict], tmp: Path) -> ServerConfig:
  """What ``thoughtjax serve`` would run with: the ConfigMap's config.yaml through the server's loader, then the
  container's flags parsed by the real command line and applied as ``cmd_serve`` applies them."""
  from thoughtjax.cli import build_parser

  path = tmp / "config.yaml"
  path.write_text(find(docs, "ConfigMap", CONFIGMAP)["data"]["config.yaml"])
  config = load_config(path)
  c = container(docs)
  args = build_parser().parse_args(c["args"])
  if c["command"] != ["thoughtjax"] or args.command != "serve":
    raise ValueError(f"the container must run `thoughtjax serve`, runs {c['command']} {c['args']}")
  flags = {"port": args.port, "bind": args.bind, "metrics_port": args.metrics_port, "http_port": args.http_port}
  return dataclasses.replace(config, **{k: v for k, v in flags.items() if v is not None}), args


def _named_ports(c: dict) -> dict[str, int]:
  return {p["name"]: p["containerPort"] for p in c["ports"]}


def _target(port: dict, named: dict[str, int]) -> int | None:
  t = port["targetPort"]
  return named.get(t) if isinstance(t, str) else t


def _mount(c: dict, volume: str) -> dict:
  (m,) = [m for m in c["volumeMounts"] if m["name"] == volume]
  return m


def _pod(docs: list[dict]) -> dict:
  return find(docs, "Deployment", DEPLOYMENT)["spec"]["template"]["spec"]


def _all_containers(pod: dict) -> list[dict]:
  return [*pod.get("initContainers", []), *pod["containers"]]


def effective_security(pod: dict, c: dict) -> dict:
  """The security context ``c`` runs with: the pod's, with the container's own fields winning (as the kubelet
  merges them; allowPrivilegeEscalation, capabilities, privileged and readOnlyRootFilesystem exist per container
  only)."""
  pod_level = {k: v for k, v in pod.get("securityContext", {}).items() if k not in ("fsGroup", "fsGroupChangePolicy")}
  return {**pod_level, **c.get("securityContext", {})}


def _seconds(duration) -> float | None:
  """An Envoy duration (``"300s"``, ``"0.1s"``) in seconds; None when unset."""
  if duration is None:
    return None
  if not isinstance(duration, str) or not duration.endswith("s"):
    raise ValueError(f"expected an Envoy duration such as '300s', got {duration!r}")
  return float(duration[:-1])


def _port_number(port, named: dict[str, int]) -> int | None:
  return named.get(port) if isinstance(port, str) else port


# ------------------------------------------------------------------------------ the checks
def problems(docs: list[dict], proxy: dict, tmp: Path) -> list[str]:
  """Every way the manifests, the server's config and the Envoy config disagree (empty: none)."""
  out: list[str] = []
  try:
    config, args = served_config(docs, tmp)
  except (ConfigError, SystemExit, ValueError) as e:  # argparse exits on an unknown flag
    return [f"the server refuses its config or flags: {e}"]
  pod = find(docs, "Deployment", DEPLOYMENT)["spec"]["template"]["spec"]
  c = container(docs)
  named = _named_ports(c)
  if config.bind in ("127.0.0.1", "::1", "localhost"):
    out.append(f"bind is {config.bind}: the kubelet's probes and the Services cannot reach a loopback address")
  want = {"grpc": config.port, "http": config.http_port, "metrics": config.metrics_port}
  for name, port in want.items():
    if named.get(name) != port:
      out.append(f"containerPort {name} is {named.get(name)}, the server binds {port}")
  if config.metrics_bind in ("127.0.0.1", "::1", "localhost"):
    out.append("metrics_bind is loopback: the pod's metrics port cannot be scraped")
  annotations = find(docs, "Deployment", DEPLOYMENT)["spec"]["template"]["metadata"].get("annotations", {})
  if annotations.get("prometheus.io/port") != str(config.metrics_port):
    out.append(f"prometheus.io/port is {annotations.get('prometheus.io/port')}, metrics_port {config.metrics_port}")

  # Probes: the native gRPC probe on the gRPC port and the service health reports.
  for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
    probe = c.get(kind, {}).get("grpc")
    if probe is None:
      out.append(f"{kind}: expected a gRPC probe on the health service")
      continue
    if probe.get("port") != config.port:
      out.append(f"{kind} probes port {probe.get('port')}, the gRPC port is {config.port}")
    if probe.get("service", "") not in ("", SERVICE):
      out.append(f"{kind} asks for service {probe.get('service')!r}, the server reports '' and {SERVICE!r}")
  live = c.get("livenessProbe", {})
  if live.get("periodSeconds", 10) * live.get("failureThreshold", 3) <= config.grace_s:
    out.append("livenessProbe would restart a replica that is still draining (period x threshold <= grace_s)")

  # Drain: the kubelet's SIGKILL comes after preStop plus the server's grace.
  pre = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
  if pod.get("terminationGracePeriodSeconds", 30) <= pre + config.grace_s:
    out.append(
      f"terminationGracePeriodSeconds {pod.get('terminationGracePeriodSeconds', 30)} must exceed preStop {pre} s "
      f"+ grace_s {config.grace_s} s, or the drain is killed"
    )

  # Volumes: the config file the flags name, the registry read-only, the cache writable.
  volumes = {v["name"]: v for v in pod["volumes"]}
  conf = _mount(c, "config")
  if (
    volumes["config"].get("configMap", {}).get("name") != CONFIGMAP or args.config != conf["mountPath"] + "/config.yaml"
  ):
    out.append(f"--config {args.config} is not the ConfigMap {CONFIGMAP}'s config.yaml at {conf['mountPath']}")
  reg = _mount(c, "registry")
  if args.registry != reg["mountPath"] or not reg.get("readOnly"):
    out.append(f"--registry {args.registry}: expected the read-only registry mount {reg['mountPath']}")
  if not volumes["registry"].get("persistentVolumeClaim", {}).get("readOnly"):
    out.append("the registry volume claim is not mounted readOnly")
  env = {e["name"]: e.get("value") for e in c.get("env", [])}
  cache = _mount(c, "cache")
  if cache.get("readOnly") or not str(env.get("THOUGHTJAX_CACHE", "")).startswith(cache["mountPath"] + "/"):
    out.append(f"THOUGHTJAX_CACHE {env.get('THOUGHTJAX_CACHE')}: expected a folder under the writable {cache}")
  if "REPLACE" not in c["image"]:
    out.append(f"image {c['image']}: there is no published image; keep the placeholder marked REPLACE")

  # Services: the headless one for gRPC, an ordinary one for HTTP, both onto the server's ports.
  selector = find(docs, "Deployment", DEPLOYMENT)["spec"]["selector"]["matchLabels"]
  for name, port, headless in ((HEADLESS, config.port, True), (HTTP_SERVICE, config.http_port, False)):
    spec = find(docs, "Service", name)["spec"]
    if (spec.get("clusterIP") == "None") != headless:
      got = spec.get("clusterIP", "unset (a VIP)")
      out.append(f"Service {name}: clusterIP {got}, expected {'None (headless)' if headless else 'a VIP'}")
    if spec.get("selector") != selector:
      out.append(f"Service {name} selects {spec.get('selector')}, the pods are {selector}")
    targets = [_target(p, named) for p in spec["ports"]]
    if targets != [port]:
      out.append(f"Service {name} targets {targets}, the server listens on {port}")

  # Envoy: each cluster on the server's ports through the headless name; gRPC over HTTP/2 with gRPC health checks.
  clusters = {cl["name"]: cl for cl in proxy["static_resources"]["clusters"]}
  for name, port in (("thoughtjax_grpc", config.port), ("thoughtjax_http", config.http_port)):
    cl = clusters.get(name)
    if cl is None:
      out.append(f"envoy: no cluster {name}")
      continue
    for group in cl["load_assignment"]["endpoints"]:
      for ep in group["lb_endpoints"]:
        addr = ep["endpoint"]["address"]["socket_address"]
        if addr["port_value"] != port:
          out.append(f"envoy cluster {name} sends to port {addr['port_value']}, the server listens on {port}")
        if not addr["address"].startswith(HEADLESS + "."):
          out.append(f"envoy cluster {name} resolves {addr['address']}, not the headless Service {HEADLESS}")
    if cl.get("common_lb_config", {}).get("healthy_panic_threshold", {}).get("value") != 0:
      out.append(f"envoy cluster {name}: panic mode would send calls to NOT_SERVING replicas")
  grpc_cluster, http_cluster = clusters.get("thoughtjax_grpc", {}), clusters.get("thoughtjax_http", {})
  h2 = grpc_cluster.get("typed_extension_protocol_options", {}).get(HTTP2, {}).get("explicit_http_config", {})
  if "http2_protocol_options" not in h2:
    out.append("envoy cluster thoughtjax_grpc does not speak HTTP/2 to the replicas (gRPC needs it)")
  checks = [h.get("grpc_health_check", {}).get("service_name") for h in grpc_cluster.get("health_checks", [])]
  if checks != [SERVICE]:
    out.append(f"envoy cluster thoughtjax_grpc health checks {checks}, expected gRPC health of {SERVICE}")
  # /health: every other route needs the client token, which Envoy's checks do not carry (they would all fail).
  paths = [h.get("http_health_check", {}).get("path") for h in http_cluster.get("health_checks", [])]
  if paths != [HEALTH]:
    out.append(f"envoy cluster thoughtjax_http health checks {paths}, expected GET {HEALTH} (needs no client token)")
  for listener in proxy["static_resources"]["listeners"]:
    for chain in listener["filter_chains"]:
      for f in chain["filters"]:
        if f["name"] != HCM:
          continue
        for vh in f["typed_config"]["route_config"]["virtual_hosts"]:
          for r in vh["routes"]:
            route = r["route"]
            if _streams(r["match"]):
              if route.get("timeout") != "0s":
                out.append(f"envoy route to {route['cluster']}: timeout {route.get('timeout')} cuts streams short")
            elif not _seconds(route.get("timeout", "15s")):
              out.append(f"envoy route {r['match']} answers at once, yet has no timeout (timeout 0s)")
            retry = set(route.get("retry_policy", {}).get("retry_on", "").split(","))
            if not retry <= SAFE_RETRIES:
              out.append(f"envoy route to {route['cluster']} retries on {sorted(retry - SAFE_RETRIES)}")
            if route["cluster"] == "thoughtjax_http" and set(
              route["retry_policy"].get("retriable_status_codes", [])
            ) - {503}:
              out.append("envoy HTTP route retries statuses other than 503 (UNAVAILABLE)")

  out += pod_security_problems(docs)
  out += cache_problems(docs)
  out += client_token_problems(docs, config)
  out += network_policy_problems(docs, config)
  out += envoy_limit_problems(proxy, docs, config)
  return out


def _streams(match: dict) -> bool:
  """Whether a route carries generations, which stream for as long as they generate: every gRPC route (Synthesize
  streams) and any HTTP route that chat or completions requests take."""
  if "grpc" in match:
    return True
  prefix, exact = match.get("prefix"), match.get("path")
  return any(path == exact or (prefix is not None and path.startswith(prefix)) for path in (CHAT, COMPLETIONS))


def pod_security_problems(docs: list[dict]) -> list[str]:
  """Where the pod or a container falls short of the "restricted" Pod Security Standard, or of a read-only root
  file system, or mounts the service-account token."""
  out = []
  pod = _pod(docs)
  if pod.get("automountServiceAccountToken") is not False:
    out.append("automountServiceAccountToken is not false: the server calls no Kubernetes API, yet gets a token")
  for key in ("hostNetwork", "hostPID", "hostIPC"):
    if pod.get(key):
      out.append(f"{key} is set: the pod shares the node's namespaces")
  fs_group = pod.get("securityContext", {}).get("fsGroup")
  if not fs_group:
    out.append(f"the pod's fsGroup is {fs_group}: expected a non-zero group owning the volumes")
  for v in pod["volumes"]:
    kinds = set(v) - {"name"}
    if not kinds <= RESTRICTED_VOLUMES:
      out.append(f"volume {v['name']} is of type {sorted(kinds)}, which the restricted profile refuses")
  for c in _all_containers(pod):
    sc, name = effective_security(pod, c), c["name"]
    if sc.get("runAsNonRoot") is not True:
      out.append(f"container {name}: runAsNonRoot is {sc.get('runAsNonRoot')}, expected true")
    for key in ("runAsUser", "runAsGroup"):
      if not sc.get(key):
        out.append(f"container {name} runs as {key} {sc.get(key)} (0 or unset: root's), expected a non-zero id")
    if sc.get("allowPrivilegeEscalation") is not False:
      out.append(f"container {name}: allowPrivilegeEscalation is {sc.get('allowPrivilegeEscalation')}, expected false")
    if sc.get("privileged"):
      out.append(f"container {name} is privileged")
    caps = sc.get("capabilities", {})
    if "ALL" not in caps.get("drop", []):
      out.append(f"container {name} drops capabilities {caps.get('drop', [])}, expected ALL")
    if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
      out.append(
        f"container {name} adds capabilities {caps['add']}; the restricted profile allows NET_BIND_SERVICE only"
      )
    seccomp = sc.get("seccompProfile", {}).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"):
      out.append(f"container {name}: seccompProfile {seccomp}, expected RuntimeDefault")
    if sc.get("readOnlyRootFilesystem") is not True:
      out.append(f"container {name}: readOnlyRootFilesystem is {sc.get('readOnlyRootFilesystem')}, expected true")
    if any("hostPort" in p for p in c.get("ports", [])):
      out.append(f"container {name} takes a hostPort")
  # A read-only root: the server's temporary files (a checkpoint's checked copy) need a writable /tmp.
  tmp = [m for m in container(docs)["volumeMounts"] if m["mountPath"] == "/tmp" and not m.get("readOnly")]
  if not tmp:
    out.append("the server has no writable /tmp, and its root file system is read-only")
  return out


def cache_problems(docs: list[dict]) -> list[str]:
  """The cache folder: made private by the init container, as the server's user, and the only part of the volume
  the server mounts (the volume's root, 0777 and root's, is refused by the cache check; see the cache test)."""
  pod, c = _pod(docs), container(docs)
  (init,) = pod["initContainers"]
  mount = _mount(c, "cache")
  out = []
  if "subPath" not in mount:
    out.append("the server mounts the cache volume's root (0777, root's): the cache check refuses a cache under it")
  command = init["command"]
  if command[:2] != ["mkdir", "-p"] or "-m" not in command:
    return [*out, f"init container {init['name']}: expected `mkdir -p -m MODE FOLDER`, runs {command}"]
  mode = int(command[command.index("-m") + 1], 8)
  if mode & 0o077:
    out.append(f"init container {init['name']} makes the cache folder with mode {mode:04o}, expected 0700")
  made = Path(_mount(init, "cache")["mountPath"]) / mount.get("subPath", "")
  if Path(command[-1]) != made:
    out.append(f"init container {init['name']} makes {command[-1]}, the server mounts {made} (subPath)")
  ids = {x["name"]: effective_security(pod, x).get("runAsUser") for x in (init, c)}
  if ids[init["name"]] != ids[c["name"]]:
    out.append(
      f"init container runs as uid {ids[init['name']]}, the server as {ids[c['name']]}: the cache check "
      "refuses a folder another user owns"
    )
  return out


def client_token_problems(docs: list[dict], config: ServerConfig) -> list[str]:
  """The client token: a file from a mounted Secret (never a value written into the manifests)."""
  out = []
  c, pod = container(docs), _pod(docs)
  clients = config.clients
  if clients.token is not None:
    out.append("clients.token is written in the ConfigMap: put the client token in a Secret (clients.token_file)")
  token_vars = [var for var, key in ENVIRONMENT.items() if key == "clients.token"]
  for e in c.get("env", []):
    if e["name"] in token_vars and "value" in e:
      out.append(f"env {e['name']} holds the client token in the Deployment: take it from a Secret")
  if clients.token_file is None:
    return [*out, "no clients.token_file: any caller that reaches Envoy is served"]
  volumes = {v["name"]: v for v in pod["volumes"]}
  file = Path(clients.token_file)
  mounts = [m for m in c["volumeMounts"] if Path(m["mountPath"]) == file.parent]
  secret = volumes[mounts[0]["name"]].get("secret") if mounts else None
  if secret is None:
    out.append(f"clients.token_file {file} is not in a mounted Secret")
  elif secret.get("items") and file.name not in [i["path"] for i in secret["items"]]:
    out.append(f"clients.token_file {file}: the Secret {secret['secretName']} gives no file {file.name}")
  return out


def network_policy_problems(docs: list[dict], config: ServerConfig) -> list[str]:
  """A NetworkPolicy on the server's pods: the serving ports from Envoy's pods only, the metrics port from a named
  Prometheus only, nothing else in, nothing out."""
  labels = find(docs, "Deployment", DEPLOYMENT)["spec"]["template"]["metadata"]["labels"]
  policies = [
    d
    for d in docs
    if d.get("kind") == "NetworkPolicy" and d["spec"]["podSelector"].get("matchLabels", {}).items() <= labels.items()
  ]
  if not policies:
    return ["no NetworkPolicy selects the server's pods: anything in the cluster reaches every port"]
  named = _named_ports(container(docs))
  serving, metrics = {config.port, config.http_port}, config.metrics_port
  out, envoy_ports = [], set()
  for policy in policies:
    spec, name = policy["spec"], policy["metadata"]["name"]
    if set(spec.get("policyTypes", [])) != {"Ingress", "Egress"}:
      out.append(f"NetworkPolicy {name}: policyTypes {spec.get('policyTypes')}, expected Ingress and Egress")
    if spec.get("egress"):
      out.append(f"NetworkPolicy {name} allows egress {spec['egress']}: the server opens no connection")
    for rule in spec.get("ingress", []):
      peers, ports = rule.get("from", []), {_port_number(p.get("port"), named) for p in rule.get("ports", [])}
      if not peers or not ports or None in ports:
        out.append(f"NetworkPolicy {name}: an ingress rule from {peers or 'anyone'} to {ports or 'every port'}")
        continue
      if ports - serving - {metrics}:
        out.append(f"NetworkPolicy {name} opens ports {sorted(ports - serving - {metrics})} the server does not serve")
      for peer in peers:
        envoy = peer == {"podSelector": {"matchLabels": ENVOY_PODS}}
        prometheus = set(peer) == {"namespaceSelector", "podSelector"} and all(
          sel.get("matchLabels") or sel.get("matchExpressions") for sel in peer.values()
        )
        if metrics in ports and not prometheus:
          out.append(f"NetworkPolicy {name} opens the metrics port to {peer}, not to a named Prometheus")
        if ports & serving and not envoy:
          out.append(f"NetworkPolicy {name} opens the serving ports to {peer}, not to Envoy's pods {ENVOY_PODS}")
        if envoy:
          envoy_ports |= ports
  if not serving <= envoy_ports:
    out.append(f"NetworkPolicy: Envoy's pods reach ports {sorted(envoy_ports)}, the server serves {sorted(serving)}")
  for name in (HEADLESS, HTTP_SERVICE):
    exposed = [_target(p, named) for p in find(docs, "Service", name)["spec"]["ports"]]
    if metrics in exposed:
      out.append(f"Service {name} exposes the metrics port {metrics}")
  return out


def envoy_limit_problems(proxy: dict, docs: list[dict], config: ServerConfig) -> list[str]:
  """Envoy's limits: each listener's timeouts and connection limit, a global connection limit, and circuit
  breakers on each cluster no lower than what the replicas would accept."""
  out = []
  monitors = proxy.get("overload_manager", {}).get("resource_monitors", [])
  limits = [
    m["typed_config"].get("max_active_downstream_connections") for m in monitors if m["name"] == GLOBAL_CONNECTIONS
  ]
  if not limits or not all(limits):
    out.append(f"envoy: no overload_manager {GLOBAL_CONNECTIONS}: downstream connections are unbounded")
  for listener in proxy["static_resources"]["listeners"]:
    name = listener["name"]
    for chain in listener["filter_chains"]:
      filters = [f["name"] for f in chain["filters"]]
      limits = [f["typed_config"].get("max_connections") for f in chain["filters"] if f["name"] == CONNECTION_LIMIT]
      if not limits or not all(limits) or filters.index(CONNECTION_LIMIT) > filters.index(HCM):
        out.append(f"envoy listener {name}: no connection limit ({CONNECTION_LIMIT} before the HTTP filter)")
      (hcm,) = [f["typed_config"] for f in chain["filters"] if f["name"] == HCM]
      for key in ("stream_idle_timeout", "request_headers_timeout", "request_timeout"):
        if not _seconds(hcm.get(key)):  # unset or 0s: no limit
          out.append(f"envoy listener {name}: no {key}")
      common = hcm.get("common_http_protocol_options", {})
      if not (_seconds(common.get("idle_timeout")) or _seconds(common.get("max_connection_duration"))):
        out.append(f"envoy listener {name}: no idle_timeout or max_connection_duration: idle connections stay")
      if not hcm.get("max_request_headers_kb"):
        out.append(f"envoy listener {name}: no max_request_headers_kb")
  replicas = find(docs, "Deployment", DEPLOYMENT)["spec"]["replicas"]
  accepted = replicas * (config.max_concurrent + config.max_queue)
  for cl in proxy["static_resources"]["clusters"]:
    thresholds = [
      t for t in cl.get("circuit_breakers", {}).get("thresholds", []) if t.get("priority", "DEFAULT") == "DEFAULT"
    ]
    keys = ("max_connections", "max_pending_requests", "max_requests", "max_retries")
    if not thresholds or not all(k in thresholds[0] for k in keys):
      out.append(f"envoy cluster {cl['name']}: no circuit breakers ({', '.join(keys)})")
    elif thresholds[0]["max_requests"] < accepted:
      out.append(
        f"envoy cluster {cl['name']}: circuit breaker max_requests {thresholds[0]['max_requests']} is below the "
        f"{accepted} calls the replicas would take ({replicas} x (max_concurrent + max_queue))"
      )
  return out


# ------------------------------------------------------------------------------ tests
def test_every_file_parses():
  files = sorted(KUBE.glob("*.yaml"))
  assert {f.name for f in files} == {"kustomization.yaml", *yaml.safe_load(KUSTOMIZATION.read_text())["resources"]}
  for f in files:
    assert all(isinstance(d, dict) for d in yaml.safe_load_all(f.read_text())), f
  assert {d["kind"] for d in manifests()} == {"ConfigMap", "Deployment", "Service", "NetworkPolicy"}
  assert set(envoy()["static_resources"]) == {"listeners", "clusters"}


def test_the_files_agree_with_one_another_and_with_the_server(tmp_path):
  assert problems(manifests(), envoy(), tmp_path) == []
  config, _ = served_config(manifests(), tmp_path)
  assert (config.port, config.http_port, config.metrics_port) == (50051, 8000, 9100)  # what the README says


def _configmap(docs):
  return find(docs, "ConfigMap", CONFIGMAP)["data"]


def _set_config(key, value):
  def edit(docs, proxy):
    data = yaml.safe_load(_configmap(docs)["config.yaml"])
    data[key] = value
    _configmap(docs)["config.yaml"] = yaml.safe_dump(data)

  return edit


def _edit_probe(docs, proxy):
  container(docs)["readinessProbe"]["grpc"]["port"] = 8000


def _edit_probe_service(docs, proxy):
  container(docs)["readinessProbe"]["grpc"]["service"] = "thoughtjax.v1.Synthesiser"


def _edit_target(docs, proxy):
  find(docs, "Service", HTTP_SERVICE)["spec"]["ports"][0]["targetPort"] = "grpc"


def _edit_headless(docs, proxy):
  del find(docs, "Service", HEADLESS)["spec"]["clusterIP"]


def _edit_grace(docs, proxy):
  find(docs, "Deployment", DEPLOYMENT)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30


def _edit_registry_rw(docs, proxy):
  del _mount(container(docs), "registry")["readOnly"]


def _edit_flag(docs, proxy):
  container(docs)["args"] += ["--port", "50052"]


def _edit_unknown_flag(docs, proxy):
  container(docs)["args"] += ["--grpc-port", "50051"]


def _envoy_cluster(proxy, name):
  (cl,) = [c for c in proxy["static_resources"]["clusters"] if c["name"] == name]
  return cl


def _edit_envoy_h1(docs, proxy):
  del _envoy_cluster(proxy, "thoughtjax_grpc")["typed_extension_protocol_options"]


def _edit_envoy_port(docs, proxy):
  ep = _envoy_cluster(proxy, "thoughtjax_http")["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
  ep["endpoint"]["address"]["socket_address"]["port_value"] = 8080


def _envoy_chain(proxy, listener):
  (x,) = [x for x in proxy["static_resources"]["listeners"] if x["name"] == listener]
  (chain,) = x["filter_chains"]
  return chain


def _envoy_hcm(proxy, listener):
  (hcm,) = [f["typed_config"] for f in _envoy_chain(proxy, listener)["filters"] if f["name"] == HCM]
  return hcm


def _envoy_route(proxy, listener, match):
  (route,) = [
    r["route"]
    for vh in _envoy_hcm(proxy, listener)["route_config"]["virtual_hosts"]
    for r in vh["routes"]
    if {k: v for k, v in r["match"].items() if k != "grpc"} == match
  ]
  return route


def _edit_envoy_retry(docs, proxy):
  _envoy_route(proxy, "grpc", {"prefix": "/"})["retry_policy"]["retry_on"] += ",reset,5xx"


def _edit_envoy_timeout(docs, proxy):
  _envoy_route(proxy, "http", {"prefix": "/v1/"})["timeout"] = "15s"


def _edit_envoy_health(docs, proxy):
  _envoy_cluster(proxy, "thoughtjax_grpc")["health_checks"][0]["grpc_health_check"]["service_name"] = "grpc.health"


def _edit_panic(docs, proxy):
  del _envoy_cluster(proxy, "thoughtjax_http")["common_lb_config"]


def _edit_annotation(docs, proxy):
  find(docs, "Deployment", DEPLOYMENT)["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = "9090"


def _edit_selector(docs, proxy):
  find(docs, "Service", HEADLESS)["spec"]["selector"] = {"app": "thoughtjax"}


def _edit_http_check(docs, proxy):
  _envoy_cluster(proxy, "thoughtjax_http")["health_checks"][0]["http_health_check"]["path"] = "/healthz"


def _init(docs):
  (init,) = _pod(docs)["initContainers"]
  return init


def _edit_init_root(docs, proxy):
  _init(docs)["securityContext"]["runAsUser"] = 0


def _edit_init_other_user(docs, proxy):
  _init(docs)["securityContext"]["runAsUser"] = 10002


def _edit_writable_root(docs, proxy):
  del container(docs)["securityContext"]["readOnlyRootFilesystem"]


def _edit_escalation(docs, proxy):
  _init(docs)["securityContext"]["allowPrivilegeEscalation"] = True


def _edit_capabilities(docs, proxy):
  container(docs)["securityContext"]["capabilities"] = {"add": ["NET_ADMIN"]}


def _edit_seccomp(docs, proxy):
  _pod(docs)["securityContext"]["seccompProfile"] = {"type": "Unconfined"}


def _edit_pod_root(docs, proxy):
  del _pod(docs)["securityContext"]["runAsUser"]


def _edit_host_path(docs, proxy):
  _pod(docs)["volumes"].append({"name": "host", "hostPath": {"path": "/"}})


def _edit_sa_token(docs, proxy):
  del _pod(docs)["automountServiceAccountToken"]


def _edit_no_tmp(docs, proxy):
  c = container(docs)
  c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != "/tmp"]


def _edit_cache_root(docs, proxy):
  del _mount(container(docs), "cache")["subPath"]


def _edit_cache_mode(docs, proxy):
  command = _init(docs)["command"]
  command[command.index("-m") + 1] = "1777"


def _edit_token_in_config(docs, proxy):
  _set_config("clients", {"token": "a-client-token-in-plain-sight"})(docs, proxy)


def _edit_token_env(docs, proxy):
  _set_config("clients", None)(docs, proxy)
  container(docs)["env"].append({"name": "THOUGHTJAX_API_KEY", "value": "a-client-token-in-plain-sight"})


def _edit_token_path(docs, proxy):
  _set_config("clients", {"token_file": "/etc/thoughtjax/token"})(docs, proxy)


def _drop_policy(docs, proxy):
  docs[:] = [d for d in docs if d.get("kind") != "NetworkPolicy"]


def _policy(docs):
  return find(docs, "NetworkPolicy", DEPLOYMENT)["spec"]


def _rule(docs, port):
  """The policy's ingress rule that opens ``port``."""
  (rule,) = [r for r in _policy(docs)["ingress"] if port in [p["port"] for p in r["ports"]]]
  return rule


def _edit_policy_metrics_open(docs, proxy):
  del _rule(docs, 9100)["from"]


def _edit_policy_metrics_envoy(docs, proxy):
  _rule(docs, 50051)["ports"].append({"protocol": "TCP", "port": "metrics"})


def _edit_policy_egress(docs, proxy):
  _policy(docs)["egress"] = [{"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}]


def _edit_policy_envoy_label(docs, proxy):
  _rule(docs, 50051)["from"] = [{"podSelector": {"matchLabels": {"app": "envoy"}}}]


def _edit_service_metrics(docs, proxy):
  find(docs, "Service", HTTP_SERVICE)["spec"]["ports"].append(
    {"name": "metrics", "port": 9100, "targetPort": "metrics"}
  )


def _edit_envoy_idle(docs, proxy):
  del _envoy_hcm(proxy, "grpc")["stream_idle_timeout"]


def _edit_envoy_idle_zero(docs, proxy):
  _envoy_hcm(proxy, "http")["stream_idle_timeout"] = "0s"


def _edit_envoy_headers_timeout(docs, proxy):
  del _envoy_hcm(proxy, "http")["request_headers_timeout"]


def _edit_envoy_connection_idle(docs, proxy):
  del _envoy_hcm(proxy, "grpc")["common_http_protocol_options"]


def _edit_envoy_connection_limit(docs, proxy):
  chain = _envoy_chain(proxy, "http")
  chain["filters"] = [f for f in chain["filters"] if f["name"] != CONNECTION_LIMIT]


def _edit_envoy_overload(docs, proxy):
  del proxy["overload_manager"]


def _edit_envoy_breakers(docs, proxy):
  del _envoy_cluster(proxy, "thoughtjax_grpc")["circuit_breakers"]


def _edit_envoy_breakers_low(docs, proxy):
  _envoy_cluster(proxy, "thoughtjax_http")["circuit_breakers"]["thresholds"][0]["max_requests"] = 16


def _edit_envoy_models_timeout(docs, proxy):
  _envoy_route(proxy, "http", {"path": "/v1/models"})["timeout"] = "0s"


MUTATIONS = {
  "wrong gRPC port in the config": (_set_config("port", 50052), "containerPort grpc is 50051, the server binds 50052"),
  "wrong HTTP port in the config": (_set_config("http_port", 8080), "the server listens on 8080"),
  "unknown key in the config": (_set_config("htp_port", 8000), "unknown keys ['htp_port']"),
  "ill-typed value in the config": (_set_config("grace_s", "30s"), "grace_s: expected a finite number"),
  "loopback bind": (_set_config("bind", "127.0.0.1"), "bind is 127.0.0.1"),
  "grace longer than the pod's": (_set_config("grace_s", 60), "terminationGracePeriodSeconds 45 must exceed"),
  "a flag overriding the port": (_edit_flag, "the server binds 50052"),
  "a flag serve does not know": (_edit_unknown_flag, "the server refuses its config or flags"),
  "readiness on the HTTP port": (_edit_probe, "readinessProbe probes port 8000, the gRPC port is 50051"),
  "readiness on a misspelt service": (_edit_probe_service, "readinessProbe asks for service"),
  "HTTP Service onto the gRPC port": (_edit_target, "Service thoughtjax-http targets [50051]"),
  "headless Service with a VIP": (
    _edit_headless,
    "Service thoughtjax-headless: clusterIP unset (a VIP), expected None",
  ),
  "termination grace too short": (_edit_grace, "terminationGracePeriodSeconds 30 must exceed"),
  "registry mounted writable": (_edit_registry_rw, "expected the read-only registry mount"),
  "Envoy gRPC cluster over HTTP/1.1": (_edit_envoy_h1, "does not speak HTTP/2"),
  "Envoy HTTP cluster on another port": (_edit_envoy_port, "sends to port 8080, the server listens on 8000"),
  "Envoy retrying started streams": (_edit_envoy_retry, "retries on ['5xx', 'reset']"),
  "Envoy route timeout": (_edit_envoy_timeout, "timeout 15s cuts streams short"),
  "Envoy health of another service": (_edit_envoy_health, "expected gRPC health of thoughtjax.v1.Synthesizer"),
  "Envoy panic mode left on": (_edit_panic, "panic mode would send calls to NOT_SERVING replicas"),
  "Envoy HTTP check on a route the server lacks": (_edit_http_check, "expected GET /health"),
  "scrape annotation on another port": (_edit_annotation, "prometheus.io/port is 9090, metrics_port 9100"),
  "Service selecting no pod": (_edit_selector, "Service thoughtjax-headless selects"),
  # the restricted profile, the read-only root, the service-account token
  "init container back to root": (_edit_init_root, "container cache-folder runs as runAsUser 0"),
  "pod without a user": (_edit_pod_root, "container thoughtjax runs as runAsUser None"),
  "writable root file system": (_edit_writable_root, "container thoughtjax: readOnlyRootFilesystem is None"),
  "privilege escalation": (_edit_escalation, "container cache-folder: allowPrivilegeEscalation is True"),
  "capabilities kept and added": (_edit_capabilities, "container thoughtjax drops capabilities [], expected ALL"),
  "seccomp off": (_edit_seccomp, "seccompProfile Unconfined"),
  "a hostPath volume": (_edit_host_path, "volume host is of type ['hostPath']"),
  "service-account token mounted": (_edit_sa_token, "automountServiceAccountToken is not false"),
  "no writable /tmp": (_edit_no_tmp, "no writable /tmp"),
  # the cache folder
  "cache volume's root mounted": (_edit_cache_root, "the server mounts the cache volume's root"),
  "cache folder writable by others": (_edit_cache_mode, "makes the cache folder with mode 1777"),
  "init container as another user": (_edit_init_other_user, "init container runs as uid 10002, the server as 10001"),
  # the client token
  "client token in the ConfigMap": (_edit_token_in_config, "clients.token is written in the ConfigMap"),
  "client token in an env value": (_edit_token_env, "env THOUGHTJAX_API_KEY holds the client token"),
  "client token file off the Secret": (_edit_token_path, "is not in a mounted Secret"),
  # the NetworkPolicy and the Services
  "no NetworkPolicy": (_drop_policy, "no NetworkPolicy selects the server's pods"),
  "metrics open to anyone": (_edit_policy_metrics_open, "an ingress rule from anyone"),
  "metrics open to Envoy": (_edit_policy_metrics_envoy, "opens the metrics port to"),
  "egress allowed": (_edit_policy_egress, "allows egress"),
  "serving ports open to other pods": (_edit_policy_envoy_label, "not to Envoy's pods"),
  "metrics on the public Service": (_edit_service_metrics, "Service thoughtjax-http exposes the metrics port"),
  # Envoy's limits
  "Envoy listener without stream_idle_timeout": (_edit_envoy_idle, "envoy listener grpc: no stream_idle_timeout"),
  "Envoy stream_idle_timeout off": (_edit_envoy_idle_zero, "envoy listener http: no stream_idle_timeout"),
  "Envoy listener without a headers timeout": (_edit_envoy_headers_timeout, "http: no request_headers_timeout"),
  "Envoy idle connections kept": (_edit_envoy_connection_idle, "grpc: no idle_timeout or max_connection_duration"),
  "Envoy listener without a connection limit": (_edit_envoy_connection_limit, "envoy listener http: no connection"),
  "Envoy without a global connection limit": (_edit_envoy_overload, "downstream connections are unbounded"),
  "Envoy cluster without circuit breakers": (_edit_envoy_breakers, "envoy cluster thoughtjax_grpc: no circuit"),
  "Envoy circuit breaker below capacity": (_edit_envoy_breakers_low, "max_requests 16 is below the 40 calls"),
  "Envoy /v1/models without a timeout": (_edit_envoy_models_timeout, "answers at once, yet has no timeout"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_mistake_is_caught(mutation, tmp_path):
  edit, expected = MUTATIONS[mutation]
  docs, proxy = copy.deepcopy(manifests()), copy.deepcopy(envoy())
  edit(docs, proxy)
  found = problems(docs, proxy, tmp_path)
  assert any(expected in p for p in found), found


def test_the_config_loader_itself_refuses_the_mutated_configmap(tmp_path):
  """The unknown-key check is the server's, not the test's: ``load_config`` raises on the ConfigMap's text."""
  docs = copy.deepcopy(manifests())
  _set_config("htp_port", 8000)(docs, None)
  path = tmp_path / "config.yaml"
  path.write_text(_configmap(docs)["config.yaml"])
  with pytest.raises(ConfigError, match="unknown keys"):
    load_config(path)


def test_the_init_container_makes_the_cache_volume_acceptable_to_the_cache_check(tmp_path):
  """An emptyDir's root is mode 0777 (2777 with fsGroup) and root's: the cache check refuses a cache under it, and no
  non-root container may chmod it. The init container, as the server's user, makes a private folder in the volume,
  and the server mounts only that folder (subPath): the server's own cache logic then creates its folder there."""
  docs = manifests()
  pod, server = _pod(docs), container(docs)
  (init,) = pod["initContainers"]
  assert cache_problems(docs) == []
  volume_in_init = Path(_mount(init, "cache")["mountPath"])
  mount = _mount(server, "cache")
  env = {e["name"]: e["value"] for e in server["env"] if "value" in e}
  cache = Path(env["THOUGHTJAX_CACHE"]).relative_to(mount["mountPath"])
  assert effective_security(pod, init)["runAsUser"] == effective_security(pod, server)["runAsUser"] != 0

  volume = tmp_path / "volume"  # the node's side of the emptyDir, as the kubelet makes it
  volume.mkdir()
  volume.chmod(0o2777)
  with pytest.raises(UnsafeCacheError, match="writable by others"):
    private_dir(volume / cache)  # the whole volume mounted at the cache's mountPath
  assert not (volume / cache).exists()

  # The init container's own command, on the node's folder in place of its mount.
  *command, folder = init["command"]
  subprocess.run([*command, str(volume / Path(folder).relative_to(volume_in_init))], check=True, timeout=30)

  # The server's side: a subPath is a bind mount of that folder (its owner and mode as they are) at mountPath, under
  # the image's own directories (root's, 0755).
  image = tmp_path / "image"
  image.mkdir(mode=0o755)
  seen = image / Path(mount["mountPath"]).relative_to("/")
  seen.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
  os.rename(volume / mount["subPath"], seen)
  inside = seen / cache
  assert private_dir(inside) == inside and inside.stat().st_mode & 0o777 == 0o700


def test_every_pod_and_container_meets_the_restricted_pod_security_standard():
  """runAsNonRoot with non-zero ids, no privilege escalation, every capability dropped, the runtime's seccomp profile,
  a read-only root file system, only the profile's volume types and no service-account token: for the pod and for
  each container as the kubelet merges their security contexts."""
  docs = manifests()
  pod = _pod(docs)
  assert pod_security_problems(docs) == []
  assert [c["name"] for c in _all_containers(pod)] == ["cache-folder", "thoughtjax"]
  assert pod["automountServiceAccountToken"] is False
  for c in _all_containers(pod):
    sc = effective_security(pod, c)
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0 and sc["runAsGroup"] > 0, c["name"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}, c["name"]
  assert pod["securityContext"]["fsGroup"] > 0
  # No Namespace is defined here, so the label that makes the API server enforce the profile is the operator's: the
  # files must say so.
  assert not [d for d in docs if d["kind"] == "Namespace"]
  assert "pod-security.kubernetes.io/enforce=restricted" in (KUBE / "deployment.yaml").read_text()


def test_a_network_policy_selects_the_server_pods_and_admits_only_envoy_and_prometheus(tmp_path):
  docs = manifests()
  config, _ = served_config(docs, tmp_path)
  assert network_policy_problems(docs, config) == []
  spec = find(docs, "NetworkPolicy", DEPLOYMENT)["spec"]
  assert spec["podSelector"]["matchLabels"] == find(docs, "Deployment", DEPLOYMENT)["spec"]["selector"]["matchLabels"]
  assert spec["egress"] == [] and set(spec["policyTypes"]) == {"Ingress", "Egress"}  # deny everything not listed
  envoy = {"podSelector": {"matchLabels": ENVOY_PODS}}
  allowed = {(p["port"], peer == envoy) for rule in spec["ingress"] for p in rule["ports"] for peer in rule["from"]}
  assert allowed == {(50051, True), (8000, True), (9100, False)}  # (port, from Envoy's pods)
  # Envoy's pods must carry the label the policy admits: its config says so.
  assert "app.kubernetes.io/name: thoughtjax-envoy" in ENVOY.read_text()


def test_the_client_token_comes_from_a_secret(tmp_path):
  """The server reads the token from clients.token_file, a file of a mounted Secret; no token is written in the
  manifests."""
  docs = manifests()
  config, _ = served_config(docs, tmp_path)
  assert client_token_problems(docs, config) == []
  assert config.clients.token is None and config.clients.token_file == Path("/etc/thoughtjax-client/token")
  volume = {v["name"]: v for v in _pod(docs)["volumes"]}["client-token"]
  assert volume["secret"]["secretName"] == "thoughtjax-client-token"
  assert _mount(container(docs), "client-token")["mountPath"] == "/etc/thoughtjax-client"
  # A token file in the Secret's place is what the server reads (16 characters at least).
  token = tmp_path / "token"
  token.write_text("x" * 48 + "\n")
  assert dataclasses.replace(config.clients, token_file=token).bearer() == "x" * 48


def test_envoy_has_timeouts_connection_limits_and_circuit_breakers(tmp_path):
  docs, proxy = manifests(), envoy()
  config, _ = served_config(docs, tmp_path)
  assert envoy_limit_problems(proxy, docs, config) == []
  for listener in ("grpc", "http"):
    hcm = _envoy_hcm(proxy, listener)
    assert _seconds(hcm["stream_idle_timeout"]) == 300 and _seconds(hcm["request_headers_timeout"]) == 10
  # Streams stay open as long as they generate: the generation routes have no timeout (what bounds them is the
  # stream idle timeout above), and only the route that answers at once has one.
  assert _envoy_route(proxy, "grpc", {"prefix": "/"})["timeout"] == "0s"
  assert _envoy_route(proxy, "http", {"prefix": "/v1/"})["timeout"] == "0s"
  assert _seconds(_envoy_route(proxy, "http", {"path": "/v1/models"})["timeout"]) == 10


@pytest.mark.skipif(shutil.which("envoy") is None, reason="envoy not installed")
def test_envoy_accepts_the_config_and_the_commented_tls(tmp_path):
  """``envoy --mode validate`` (no network needed) on the file, and on the file with each listener's commented
  transport_socket turned on, with a certificate made here in place of the operator's."""

  def validate(path):
    out = subprocess.run(["envoy", "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

  validate(ENVOY)
  key = ec.generate_private_key(ec.SECP256R1())
  name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "envoy")])
  now = datetime.datetime.now(datetime.UTC)
  cert = (
    x509.CertificateBuilder()
    .subject_name(name)
    .issuer_name(name)
    .public_key(key.public_key())
    .serial_number(x509.random_serial_number())
    .not_valid_before(now - datetime.timedelta(minutes=5))
    .not_valid_after(now + datetime.timedelta(days=1))
    .sign(key, hashes.SHA256())
  )
  (tmp_path / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
  (tmp_path / "tls.key").write_bytes(
    key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
  )
  lines, on, turned_on = [], False, 0
  for line in ENVOY.read_text().splitlines():
    if on and line.lstrip().startswith("# "):
      i = line.index("#")
      line = line[:i] + line[i + 2 :]
      turned_on += line.strip() == "transport_socket:"
    else:
      on = "uncomment these lines" in line
    lines.append(line)
  assert turned_on == 2  # both listeners
  tls = tmp_path / "envoy-tls.yaml"
  tls.write_text("\n".join(lines).replace("/etc/envoy/tls/", f"{tmp_path}/"))
  sockets = [
    c.get("transport_socket")
    for x in yaml.safe_load(tls.read_text())["static_resources"]["listeners"]
    for c in x["filter_chains"]
  ]
  assert all(s and s["name"] == "envoy.transport_sockets.tls" for s in sockets)
  validate(tls)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds_the_same_objects():
  """``kubectl kustomize`` (offline: no cluster needed) renders exactly the listed objects."""
  out = subprocess.run(["kubectl", "kustomize", str(KUBE)], capture_output=True, text=True, timeout=60, check=True)
  rendered = list(yaml.safe_load_all(out.stdout))
  key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
  assert sorted(map(key, rendered)) == sorted(map(key, manifests()))
  assert sorted(rendered, key=key) == sorted(manifests(), key=key)
