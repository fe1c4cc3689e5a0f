"""``thoughtjax bench decode --quick`` on a tiny quantized GGUF: the weight forms are compared side by side
and the JSON holds each form's speed and quality fields (numbers are not asserted: tests never judge timings)."""

from __future__ import annotations

import json

import pytest

from tests.tiny import TINY_CONFIGS, write_gguf
from thoughtjax.cli import main
from thoughtjax.transformer import init_random


def test_bench_decode_quick_compares_weight_forms(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("THOUGHTJAX_CACHE", str(tmp_path / "cache"))
  cfg = TINY_CONFIGS["llama_gqa"]
  gguf = write_gguf(tmp_path / "tiny-q8.gguf", cfg, init_random(cfg, 1, scale=0.08), "Q8_0")
  out = tmp_path / "decode.json"
  code = main(
    [
      "bench",
      "decode",
      "--quick",
      "--skip-llama",
      "--model",
      str(gguf),
      "--weights",
      "native,int8,int8a8",
      "--json",
      str(out),
    ]
  )
  printed, _ = capsys.readouterr()
  assert code == 0
  d = json.loads(out.read_text())
  assert d["quick"] is True and d["thoughtjax"]["weights"] == "native" and d["llama_cpp"] is None
  assert list(d["weights"]) == ["native", "int8", "int8a8"]
  for form, r in d["weights"].items():
    assert r["decode_b1_tok_s"] > 0 and r["decode_b8_tok_s"] > 0 and r["prefill_tok_s"] > 0
    q = r["quality_vs_f32"]
    assert q["tokens"] > 0 and 0 <= q["top1_agreement"] <= 1 and q["mean_kl"] >= 0, (form, q)
  native, int8 = (d["weights"][w]["quality_vs_f32"] for w in ("native", "int8"))
  assert native["top1_agreement"] == 1.0 and native["mean_kl"] < 1e-9  # exact up to summation order
  assert int8["mean_kl"] > 0  # lossy, and measured
  int8a8 = d["weights"]["int8a8"]
  assert int8a8["quality_vs_f32"]["mean_kl"] > 0 and int8a8["quality_vs_f32"] != int8  # activations rounded too
  assert int8a8["weight_bytes"] == d["weights"]["int8"]["weight_bytes"]  # the same int8 weights
  assert d["weights"]["int8"]["weight_bytes"] < d["weights"]["native"]["weight_bytes"]
  assert "weight forms" in printed and "int8a8" in printed


def test_bench_decode_refuses_an_unknown_weight_form(capsys):
  with pytest.raises(SystemExit):
    main(["bench", "decode", "--weights", "f32,int4"])
  err = capsys.readouterr().err
  assert "--weights 'f32,int4'" in err and "f32, native, int8, int8a8" in err


def test_bench_decode_refuses_a_derived_form_first(capsys):
  """int8a8 is computed from a loaded int8 model's parts: the main table cannot load it by name."""
  with pytest.raises(SystemExit):
    main(["bench", "decode", "--weights", "int8a8,native"])
  err = capsys.readouterr().err
  assert "int8a8 is compared in the weight-forms table only" in err and "e.g. native,int8a8" in err
