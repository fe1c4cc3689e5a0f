"""The deployment files of ``server/deploy/``: each parses, and they agree with one another and with the server.

The ConfigMap's ``config.yaml`` goes through the server's own loader (:func:`thoughtjax.server.config.load_config`) and the
container's arguments through the command line's own parser, so the ports checked are the ones ``thoughtjax serve``
would bind. :func:`problems` lists every disagreement; the mutation tests show each kind of mistake is caught.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from thoughtjax.cachedir import UnsafeCacheError, private_dir
from thoughtjax.server.config import ConfigError, ServerConfig, load_config
from thoughtjax.server.http import MODELS
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
  paths = [h.get("http_health_check", {}).get("path") for h in http_cluster.get("health_checks", [])]
  if paths != [MODELS]:
    out.append(f"envoy cluster thoughtjax_http health checks {paths}, expected GET {MODELS}")
  for listener in proxy["static_resources"]["listeners"]:
    for chain in listener["filter_chains"]:
      for f in chain["filters"]:
        for vh in f["typed_config"]["route_config"]["virtual_hosts"]:
          for r in vh["routes"]:
            route = r["route"]
            if route.get("timeout") != "0s":
              out.append(f"envoy route to {route['cluster']}: timeout {route.get('timeout')} cuts streams short")
            retry = set(route.get("retry_policy", {}).get("retry_on", "").split(","))
            if not retry <= SAFE_RETRIES:
              out.append(f"envoy route to {route['cluster']} retries on {sorted(retry - SAFE_RETRIES)}")
            if route["cluster"] == "thoughtjax_http" and set(
              route["retry_policy"].get("retriable_status_codes", [])
            ) - {503}:
              out.append("envoy HTTP route retries statuses other than 503 (UNAVAILABLE)")
  return out


# ------------------------------------------------------------------------------ tests
def test_every_file_parses():
  files = sorted(KUBE.glob("*.yaml"))
  assert {f.name for f in files} == {"kustomization.yaml", *yaml.safe_load(KUSTOMIZATION.read_text())["resources"]}
  for f in files:
    assert all(isinstance(d, dict) for d in yaml.safe_load_all(f.read_text())), f
  assert {d["kind"] for d in manifests()} == {"ConfigMap", "Deployment", "Service"}
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


def _edit_envoy_retry(docs, proxy):
  route = proxy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
  route["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["retry_policy"]["retry_on"] += ",reset,5xx"


def _edit_envoy_timeout(docs, proxy):
  route = proxy["static_resources"]["listeners"][1]["filter_chains"][0]["filters"][0]["typed_config"]
  route["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["timeout"] = "15s"


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
  "Envoy HTTP check on a route the server lacks": (_edit_http_check, "expected GET /v1/models"),
  "scrape annotation on another port": (_edit_annotation, "prometheus.io/port is 9090, metrics_port 9100"),
  "Service selecting no pod": (_edit_selector, "Service thoughtjax-headless selects"),
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


def test_the_init_container_makes_the_cache_volume_acceptable_to_the_cache_check(tmp_path, monkeypatch):
  """An emptyDir is mode 0777; the cache check refuses a folder under it. After the init container's chmod the
  server's own cache logic creates its private folder there."""
  pod = find(manifests(), "Deployment", DEPLOYMENT)["spec"]["template"]["spec"]
  (init,) = pod["initContainers"]
  chmod, mode, target = init["command"]
  assert (
    chmod == "chmod"
    and target == _mount(init, "cache")["mountPath"] == _mount(container(manifests()), "cache")["mountPath"]
  )
  env = {e["name"]: e["value"] for e in container(manifests())["env"]}
  volume = tmp_path / "volume"
  volume.mkdir()
  inside = volume / Path(env["THOUGHTJAX_CACHE"]).relative_to(target)
  volume.chmod(0o777)  # as the kubelet makes it
  with pytest.raises(UnsafeCacheError, match="writable by others"):
    private_dir(inside)
  assert not inside.exists()
  volume.chmod(int(mode, 8))
  assert private_dir(inside) == inside and inside.stat().st_mode & 0o777 == 0o700


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds_the_same_objects():
  """``kubectl kustomize`` (offline: no cluster needed) renders exactly the listed objects."""
  out = subprocess.run(["kubectl", "kustomize", str(KUBE)], capture_output=True, text=True, timeout=60, check=True)
  rendered = list(yaml.safe_load_all(out.stdout))
  key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
  assert sorted(map(key, rendered)) == sorted(map(key, manifests()))
  assert sorted(rendered, key=key) == sorted(manifests(), key=key)
