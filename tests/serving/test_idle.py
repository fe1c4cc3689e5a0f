"""The idle tracker of scale to zero with a fake clock (holds, idle times, the start gate) and the heap policy."""

from __future__ import annotations

import ctypes
import threading

from thoughtjax.serving.idle import IdleTracker, trim_memory


class Clock:
  def __init__(self):
    self.t = 100.0

  def __call__(self) -> float:
    return self.t


def test_a_path_is_due_only_when_nobody_held_it_for_the_idle_time():
  clock = Clock()
  idle = IdleTracker(10.0, clock=clock)
  idle.seen(["a"])  # resident since now (warmed, say)
  assert idle.due() == [] and idle.next_due_in() == 10.0
  clock.t += 10.0
  assert idle.due() == ["a"]
  idle.hold("a")  # a request runs it: never due while held, however long
  clock.t += 1000.0
  assert idle.due() == [] and idle.held("a") and idle.next_due_in() is None
  idle.hold("a")
  idle.let_go("a")
  assert idle.due() == []  # one request still holds it
  idle.let_go("a")  # the last one ended: its idle time starts now
  assert idle.due() == [] and idle.due(now=clock.t + 9.9) == [] and idle.due(now=clock.t + 10.0) == ["a"]
  idle.forget("a")
  assert idle.due(now=clock.t + 1e6) == [] and idle.resident() == [] and idle.released == 1


def test_paths_no_longer_resident_are_forgotten_and_none_is_ever_due_without_an_idle_time():
  clock = Clock()
  idle = IdleTracker(5.0, clock=clock)
  idle.seen(["a", "b"])
  idle.hold("b")
  idle.seen([])  # both dropped elsewhere (an LRU): "a" forgotten, "b" is held
  assert idle.resident() == ["b"]
  never = IdleTracker(None, clock=clock)
  never.seen(["a"])
  assert never.due(now=1e12) == [] and never.next_due_in() is None


def test_a_release_is_refused_while_a_start_is_in_flight_and_a_start_waits_for_a_release():
  idle = IdleTracker(1.0)
  with idle.starting():
    with idle.releasing() as clear:
      assert clear is False  # a request between its turn and its path: not now
  order: list[str] = []
  trying = threading.Event()

  def start():
    trying.set()
    with idle.starting():
      order.append("started")

  with idle.releasing() as clear:
    assert clear is True
    t = threading.Thread(target=start)
    t.start()
    assert trying.wait(60)
    with idle.releasing() as again:
      assert again is False  # one release at a time
    order.append("released")
  t.join(60)
  assert order == ["released", "started"]


def test_trim_reports_what_it_did():
  try:
    ctypes.CDLL("libc.so.6").malloc_trim  # noqa: B018
    glibc = True
  except (OSError, AttributeError):
    glibc = False
  got = trim_memory()
  assert got["trimmed"] is glibc and got["collected"] >= 0
