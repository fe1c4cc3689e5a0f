"""The machine fingerprint a latency calibration is kept under: the command line, a notebook and the tests share it."""

from __future__ import annotations

from thoughtjax import MEMORY_SCHEDULER_FLAG
from thoughtjax.synthesis.calibrate_latency import machine_fingerprint


def test_the_scheduler_flag_and_fake_host_devices_keep_the_fingerprint(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "")
  plain = machine_fingerprint()
  monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {MEMORY_SCHEDULER_FLAG}")
  assert machine_fingerprint() == plain  # a CLI process, a test process and a notebook kernel: one calibration
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
  assert machine_fingerprint() != plain  # a flag that changes what a step costs still counts
