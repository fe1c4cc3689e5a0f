"""The grpc.aio server of :class:`~thoughtjax.server.servicer.SynthesizerService`: health, reflection, TLS, keepalive,
metrics, the OpenAI-compatible HTTP endpoint (``http_port``; off unless set, ``thoughtjax serve`` sets it), idle
release and drain.

:class:`ServerApp` binds the port first and answers NOT_SERVING (every call UNAVAILABLE) while the registry
loads and the configured hints warm, then SERVING; SIGTERM drains (NOT_SERVING, the streams in flight finish up
to ``grace_s``). :func:`serve` runs one until a signal (``thoughtjax serve``); :class:`BackgroundServer` runs
one on its own event loop thread (tests, notebooks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from thoughtjax.server.config import ConfigError, ServerConfig
from thoughtjax.server.reload import warm_set
from thoughtjax.server.scheduling import Scheduler
from thoughtjax.server.servicer import SERVICE, SynthesizerService
from thoughtjax.server.tls import server_credentials

log = logging.getLogger("thoughtjax.server")

_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class ServerApp:
  """One server: the servicer, grpc.health.v1 (NOT_SERVING while warming, SERVING when ready, NOT_SERVING
  while draining) and reflection, on ``config.address`` with TLS/mTLS by config.

  ``load``: with ``synthesizer`` None, called on a worker thread after the port is bound to make the
  synthesizer (open, build or calibrate the registry: minutes on a first start); until it returns health says
  NOT_SERVING and every call is UNAVAILABLE. ``warm``: called on a worker thread after that and before
  SERVING (default: warm the configured hints' plans). ``start()`` returns the bound port; ``drain()`` is
  what SIGTERM runs."""

  def __init__(
    self,
    synthesizer,
    config: ServerConfig | None = None,
    *,
    load: Callable[[], Any] | None = None,
    warm: Callable[[], Any] | None = None,
    scheduler: Scheduler | None = None,
  ):
    if (synthesizer is None) == (load is None):
      raise ValueError("ServerApp: give a synthesizer or a load function that makes one, not both or neither")
    self.config = config or ServerConfig()
    self.service = SynthesizerService(synthesizer, self.config, scheduler)
    self._load = load
    self.load_error: BaseException | None = None
    self.health = health.aio.HealthServicer()
    self._warm_fn = warm if warm is not None else self._default_warm
    self.server: grpc.aio.Server | None = None
    self.port: int | None = None
    self.metrics_port: int | None = None  # the Prometheus endpoint's port (config metrics_port; None: off)
    self.http = None  # the OpenAI-compatible endpoint (server/http.py; config http_port)
    self.http_port: int | None = None
    self.warm_error: BaseException | None = None
    self._warm_task: asyncio.Task | None = None
    self._idle_task: asyncio.Task | None = None  # idle release (config idle_release_s), from SERVING on
    self._stopped = asyncio.Event()

  def _default_warm(self):
    # The continuous scheduler's engines are what requests run in: warmed there, not as a lone generation.
    return warm_set(self.service.syn, self.config.warm, self.service.scheduler.pool)

  async def _set_health(self, status) -> None:
    for name in ("", SERVICE):
      await self.health.set(name, status)

  async def start(self) -> int:
    """Bind, start serving (health NOT_SERVING), warm in the background; returns the bound port."""
    cfg = self.config
    await self._set_health(_NOT_SERVING)
    self.server = grpc.aio.server(options=cfg.grpc_options())
    self.server.add_generic_rpc_handlers((self.service.handler(),))
    health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
    creds = server_credentials(cfg.tls)
    try:
      port = (
        self.server.add_secure_port(cfg.address, creds)
        if creds is not None
        else self.server.add_insecure_port(cfg.address)
      )
    except RuntimeError as e:
      raise ConfigError(f"cannot bind {cfg.address} ({e}); pick a free --port or another bind address") from None
    self.port = port
    await self.server.start()
    if cfg.metrics_port is not None:
      try:
        self.metrics_port = self.service.metrics.serve(cfg.metrics_bind, cfg.metrics_port)
      except OSError as e:
        await self.server.stop(0)
        raise ConfigError(
          f"cannot serve metrics on {cfg.metrics_bind}:{cfg.metrics_port} ({e}); pick a free metrics_port "
          f"(0: any free port) or set it to null"
        ) from None
    if cfg.http_port is not None:
      from thoughtjax.server.http import OpenAIHttp  # imported here: aiohttp is loaded only when the endpoint is on

      self.http = OpenAIHttp(self.service)
      try:
        self.http_port = await self.http.start(cfg.bind, cfg.http_port)
      except OSError as e:
        await self.stop(0)
        raise ConfigError(
          f"cannot serve HTTP on {cfg.bind}:{cfg.http_port} ({e}); pick a free port (--http-port N, config "
          f"http_port; 0: any free port) or serve gRPC only (--no-http, http_port: null)"
        ) from None
    self._warm_task = asyncio.get_running_loop().create_task(self._warm())
    log.info(
      "thoughtjax server on %s:%d (%s)",
      cfg.bind,
      port,
      "mTLS" if cfg.tls.mutual else "TLS" if cfg.tls.enabled else "plaintext",
    )
    return port

  async def _warm(self) -> None:
    loop = asyncio.get_running_loop()
    if self.service.serving is None:
      try:
        syn = await _on_daemon_thread(self._load)
      except Exception as e:  # stays NOT_SERVING; serve() stops the server with it
        self.load_error = self.warm_error = e
        log.error("loading the registry failed, health stays NOT_SERVING: %s: %s", type(e).__name__, e)
        return
      self.service.install(syn)
      log.info("registry sequence %d loaded", self.service.serving.sequence)
    try:
      await loop.run_in_executor(None, self._warm_fn)
    except Exception as e:  # stays NOT_SERVING; the error is logged and kept
      self.warm_error = e
      log.error("warming failed, health stays NOT_SERVING: %s: %s", type(e).__name__, e)
      return
    if not self.service.draining:
      self.service.ready = True
      await self._set_health(_SERVING)
      if self.service.idle.idle_s is not None:
        self._idle_task = loop.create_task(self._release_when_idle())

  async def _release_when_idle(self) -> None:
    """Run :meth:`SynthesizerService.release_idle` on a worker when the next path may be due, until stopped.
    Health stays SERVING throughout: a request after a release restores what it needs."""
    loop = asyncio.get_running_loop()
    idle_s = self.service.idle.idle_s
    floor = min(1.0, max(0.05, idle_s / 100))  # a pass that was skipped (a start or drain in flight) retries
    while True:
      nxt = self.service.idle.next_due_in()
      await asyncio.sleep(max(floor, min(idle_s / 4 if nxt is None else nxt + 0.01, idle_s)))
      try:
        await loop.run_in_executor(None, self.service.release_idle)
      except Exception:  # never stops the timer; the next pass tries again
        log.exception("idle release failed")

  async def wait_ready(self) -> bool:
    """Until warming ended; True when the server is SERVING."""
    if self._warm_task is not None:
      await asyncio.shield(self._warm_task)
    return self.service.ready

  async def begin_drain(self) -> None:
    """Health NOT_SERVING, new calls UNAVAILABLE; calls in flight continue."""
    self.service.draining = True
    await self.health.enter_graceful_shutdown()

  async def drain(self, grace: float | None = None) -> None:
    """SIGTERM: stop taking calls, let the streams in flight finish up to ``grace`` seconds, then stop."""
    grace = self.config.grace_s if grace is None else grace
    await self.begin_drain()
    t0 = time.monotonic()
    await self.service.scheduler.wait_idle(grace)
    await self.stop(max(0.0, grace - (time.monotonic() - t0)))

  async def stop(self, grace: float | None = 0) -> None:
    if self._warm_task is not None and not self._warm_task.done():
      self._warm_task.cancel()
    if self._idle_task is not None:
      self._idle_task.cancel()
    if self.http is not None:
      await self.http.stop()
    if self.server is not None:
      await self.server.stop(grace)
    self.service.scheduler.close()
    self.service.metrics.stop()
    self.service.close()
    self._stopped.set()

  async def wait(self) -> None:
    await self._stopped.wait()


async def _on_daemon_thread(fn: Callable[[], Any]) -> Any:
  """``fn()`` on a thread of its own that does not hold up the process's exit (a registry build may take
  minutes; a SIGTERM meanwhile must not wait for it, as it would for the loop's default executor)."""
  loop = asyncio.get_running_loop()
  done = loop.create_future()

  def settle(result, error):
    if not done.done():
      done.set_exception(error) if error is not None else done.set_result(result)

  def run():
    try:
      result, error = fn(), None
    except BaseException as e:
      result, error = None, e
    try:
      loop.call_soon_threadsafe(settle, result, error)
    except RuntimeError:  # the loop has ended (the server stopped meanwhile)
      pass

  threading.Thread(target=run, name="thoughtjax-load", daemon=True).start()
  return await done


async def serve(
  synthesizer,
  config: ServerConfig,
  *,
  load: Callable[[], Any] | None = None,
  on_port: Callable[[int], None] | None = None,
  on_metrics_port: Callable[[int], None] | None = None,
  on_http_port: Callable[[int], None] | None = None,
  on_ready: Callable[[Any], None] | None = None,
) -> None:
  """Run until SIGTERM or SIGINT (then drain, see :meth:`ServerApp.drain`). With ``load`` (and no
  ``synthesizer``) the port is bound first and the registry loaded behind NOT_SERVING; a load that fails
  stops the server and raises its error. ``on_ready(registry)``: called once health says SERVING, with the
  registry served."""
  app = ServerApp(synthesizer, config, load=load)
  port = await app.start()
  if on_port is not None:
    on_port(port)
  if on_metrics_port is not None and app.metrics_port is not None:
    on_metrics_port(app.metrics_port)
  if on_http_port is not None and app.http_port is not None:
    on_http_port(app.http_port)
  loop = asyncio.get_running_loop()
  for sig in (signal.SIGTERM, signal.SIGINT):
    loop.add_signal_handler(sig, lambda: loop.create_task(app.drain()))

  async def stop_if_load_fails():
    ready = await app.wait_ready()
    if app.load_error is not None:
      await app.stop(0)
    elif ready and on_ready is not None:
      on_ready(app.service.serving.registry)

  watch = loop.create_task(stop_if_load_fails())
  await app.wait()
  watch.cancel()
  if app.load_error is not None:
    raise app.load_error


class BackgroundServer:
  """A server on its own event loop thread (tests, notebooks): ``with BackgroundServer(syn, cfg) as s:``
  then ``s.port``; ``s.call(coroutine_function)`` runs on the server's loop."""

  def __init__(
    self,
    synthesizer,
    config: ServerConfig | None = None,
    *,
    load: Callable[[], Any] | None = None,
    warm: Callable[[], Any] | None = None,
    scheduler: Scheduler | None = None,
    timeout: float = 60.0,
  ):
    self._args = (synthesizer, config or ServerConfig(port=0))
    self._kwargs = dict(load=load, warm=warm, scheduler=scheduler)
    self.timeout = timeout
    self.loop: asyncio.AbstractEventLoop | None = None
    self.app: ServerApp | None = None
    self.port: int | None = None

  def __enter__(self) -> BackgroundServer:
    started = threading.Event()
    failure: list[BaseException] = []

    async def main():
      try:
        self.app = ServerApp(*self._args, **self._kwargs)
        self.port = await self.app.start()
      except BaseException as e:
        failure.append(e)
        return
      finally:
        started.set()
      await self.app.wait()

    def run():
      self.loop = asyncio.new_event_loop()
      try:
        self.loop.run_until_complete(main())
      finally:
        self.loop.close()

    self._thread = threading.Thread(target=run, name="thoughtjax-server", daemon=True)
    self._thread.start()
    if not started.wait(self.timeout):
      raise TimeoutError(f"the server did not start within {self.timeout} s")
    if failure:
      self._thread.join(self.timeout)
      raise failure[0]
    return self

  def call(self, fn: Callable[[], Any], timeout: float | None = None):
    """Run the coroutine ``fn()`` on the server's loop; its result."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    async def runner():
      # The result is handed over inside the coroutine: a call that stops the server (and so ends the
      # loop) still delivers it.
      try:
        done.set_result(await fn())
      except BaseException as e:
        done.set_exception(e)

    self.loop.call_soon_threadsafe(lambda: self.loop.create_task(runner()))
    return done.result(timeout or self.timeout)

  def __exit__(self, *exc) -> None:
    if self.app is not None and not self.app._stopped.is_set():
      try:
        self.call(lambda: self.app.stop(0))
      except RuntimeError:  # the loop ended meanwhile (drained)
        pass
    self._thread.join(self.timeout)
