"""Candidate quality against the full path, measured through the shared one-pass method.

Every number is checked against an independent route: each path run alone through the regular
Model/compose route (``model.with_path(path).logits``), with the metrics computed in float64 numpy.
Tiny seeded models; the real default model only in the one slow sanity test.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.synthesis.tiny_synthesis import make_model
from thoughtjax.synthesis.calibration import HintQuality, PathQuality
from thoughtjax.synthesis.quality import QualityError, Runner, measure, measure_candidates, windows

DOCS = [
  "The quick brown fox jumps over the lazy dog, twice.",
  "Contracts bind the parties that sign them.",
  "def add(a, b):\n    return a + b\n",
]
WINDOW = 24  # short windows: documents span several, and a last short piece is measured too
FULL = "embed, blocks[0:6), head"
PATHS = [
  "embed, blocks[0:3), head",
  "embed, blocks[0:5), head",
  "embed, blocks[0:2), blocks[3:6), head",
  "embed, blocks[0:4), blocks[2:6), head",
  "embed, blocks[1:6), head",
]


@pytest.fixture(scope="module")
def model():
  return make_model()


def reference(model, path: str, docs, window: int) -> tuple[float, float, float, int]:
  """(agreement, mean KL(full || path), ΔNLL, tokens) from each path run alone, in float64."""
  alone, full = model.with_path(path), model.with_path(FULL)
  agree = kl = dnll = 0.0
  tokens = 0
  for ids in windows(model.codec, docs, window):
    p = full.logits(ids)[:-1].astype(np.float64)
    q = alone.logits(ids)[:-1].astype(np.float64)
    logp = p - np.logaddexp.reduce(p, axis=-1, keepdims=True)
    logq = q - np.logaddexp.reduce(q, axis=-1, keepdims=True)
    y = ids[1:]
    agree += float(np.sum(np.argmax(p, -1) == np.argmax(q, -1)))
    kl += float(np.sum(np.exp(logp) * (logp - logq)))
    rows = np.arange(len(y))
    dnll += float(np.sum(logp[rows, y] - logq[rows, y]))
    tokens += len(y)
  return agree / tokens, kl / tokens, dnll / tokens, tokens


def test_windows_cut_documents_and_count_predicted_tokens(model):
  assert [w.tolist() for w in windows(None, [list(range(10)), [5, 6, 7], [9]], 4)] == [
    [0, 1, 2, 3],
    [4, 5, 6, 7],
    [8, 9],
    [5, 6, 7],
  ]  # a 1-token piece predicts nothing: dropped
  assert [w.tolist() for w in windows(None, [[5, 6, 7]], 2)] == [[5, 6]]
  wins = windows(model.codec, DOCS, WINDOW)
  assert np.concatenate(wins).tolist() == [t for d in DOCS for t in model.codec.encode(d)]  # no 1-token tails here
  assert all(2 <= len(w) <= WINDOW for w in wins) and len(wins) > len(DOCS)
  (q,) = measure(model, [FULL], DOCS, window=WINDOW)
  assert q.tokens == sum(len(w) - 1 for w in wins)


def test_full_path_is_exactly_lossless(model):
  full, same = measure(model, [FULL, "embed, blocks[0:2), blocks[2:6), head"], DOCS, window=WINDOW)
  assert (full.top1_agreement, full.mean_kl, full.delta_nll) == (1.0, 0.0, 0.0)
  assert same == full  # the same layer sequence written in two pieces is the full path
  # The head on the shared pass's last residual is the reference itself.
  runner = Runner(model)
  win = runner.full_pass(windows(model.codec, DOCS, WINDOW)[0])
  agree, kl, dnll = runner.compare(win, win.residuals[-1])
  assert agree.min() == 1.0 and np.abs(kl).max() < 1e-6 and np.abs(dnll).max() < 1e-6


@pytest.mark.parametrize("path", PATHS)
def test_shared_pass_equals_each_path_run_alone(model, path):
  (q,) = measure(model, [path], DOCS, window=WINDOW)
  agree, kl, dnll, tokens = reference(model, path, DOCS, WINDOW)
  assert q.tokens == tokens
  assert q.top1_agreement == pytest.approx(agree, abs=1e-12)
  assert q.mean_kl == pytest.approx(kl, abs=1e-5)
  assert q.delta_nll == pytest.approx(dnll, abs=1e-5)
  assert q.mean_kl > 1e-4  # a real cut: the comparison above is not between zeros


def test_all_paths_in_one_call_equal_each_measured_alone(model):
  together = measure(model, PATHS, DOCS, window=WINDOW)
  alone = [measure(model, [p], DOCS, window=WINDOW)[0] for p in PATHS]
  assert together == alone


def test_kl_is_never_negative_per_position(model):
  runner = Runner(model)
  for ids in windows(model.codec, DOCS, WINDOW):
    win = runner.full_pass(ids)
    for path in PATHS:
      _, kl, _ = runner.compare(win, runner.run(win, runner.layers_of(path)))
      assert kl.min() >= -1e-6
  assert all(q.mean_kl >= 0 for q in measure(model, PATHS, DOCS, window=WINDOW))


def test_skipping_an_identity_block_is_lossless():
  model = make_model(identity=3)
  skip, other = measure(
    model, ["embed, blocks[0:3), blocks[4:6), head", "embed, blocks[0:2), blocks[3:6), head"], DOCS, window=WINDOW
  )
  assert skip.top1_agreement == 1.0 and skip.mean_kl < 1e-7 and abs(skip.delta_nll) < 1e-7
  assert other.mean_kl > 1e-4 and other.top1_agreement < 1.0


def test_measure_candidates_shares_the_full_path_per_corpus_split(model):
  from thoughtjax.synthesis.candidates import CandidateSettings, propose

  proposals = propose(
    model, DOCS, CandidateSettings(exits=[3], single_skips=0, greedy_removals=0, repeats=[(2, 4)], window=WINDOW)
  )
  corpora = {"code_generation": (DOCS[2:], DOCS[:1]), "legal_analysis": (DOCS[1:2], DOCS[:2])}
  seen = []
  got = measure_candidates(model, proposals, corpora, window=WINDOW, progress=lambda *a: seen.append(a))
  assert set(got) == {p.path_hash for p in proposals}
  for p in proposals:
    for hint, (cal, held) in corpora.items():
      hq = got[p.path_hash][hint]
      assert isinstance(hq, HintQuality)
      assert hq.calibration == measure(model, [p.path], cal, window=WINDOW)[0]
      assert hq.heldout == measure(model, [p.path], held, window=WINDOW)[0]
  full = got[proposals[0].path_hash]["code_generation"].calibration
  assert (full.top1_agreement, full.mean_kl, full.delta_nll) == (1.0, 0.0, 0.0)
  total = sum(len(windows(model.codec, docs, WINDOW)) for pair in corpora.values() for docs in pair)
  assert [s[0] for s in seen] == list(range(1, total + 1)) and {s[1] for s in seen} == {total}
  assert {s[2] for s in seen} == {f"{h}/{s}" for h in corpora for s in ("calibration", "heldout")}


def test_refusals_name_the_problem(model):
  with pytest.raises(QualityError, match="2 or more tokens"):
    measure(model, [FULL], ["", "a"[:0]], window=WINDOW)
  with pytest.raises(QualityError, match=r"holds no weights for layers \[2, 3, 4, 5\]"):
    measure(model.with_path("embed, blocks[0:2), head"), [FULL], DOCS)
  with pytest.raises(QualityError, match="bridge"):
    measure(model, ["embed, blocks[0:2), bridge, blocks[4:6), head"], DOCS)
  with pytest.raises(QualityError, match=r"layers \[9\] are outside 0..5"):
    measure(model, [[0, 1, 9]], DOCS)
  with pytest.raises(QualityError, match="window size"):
    measure(model, [FULL], DOCS, window=1)
  with pytest.raises(QualityError, match="no codec"):
    windows(None, ["text"], 8)
  proposals = [type("P", (), {"path": FULL, "path_hash": "x"})()] * 2
  with pytest.raises(QualityError, match="more than once"):
    measure_candidates(model, proposals, {"h": (DOCS, DOCS)})
  with pytest.raises(QualityError, match=r"expected \(calibration documents, held-out documents\)"):
    measure_candidates(model, proposals[:1], {"h": DOCS})


@pytest.mark.slow
def test_default_model_exits_agree_less_the_earlier_they_exit(default_model):
  docs = [
    "The capital of France is Paris, a city on the Seine known for its museums and cafes.",
    "To make bread, mix flour, water, salt and yeast, knead the dough and let it rise.",
  ]
  full, e24, e20, e12 = measure(
    default_model,
    [
      "embed, blocks[0:30), head",
      "embed, blocks[0:24), head",
      "embed, blocks[0:20), head",
      "embed, blocks[0:12), head",
    ],
    docs,
  )
  assert (full.top1_agreement, full.mean_kl, full.delta_nll) == (1.0, 0.0, 0.0)
  assert e12.top1_agreement <= e20.top1_agreement <= e24.top1_agreement < 1.0
  assert e24.mean_kl < e12.mean_kl and e24.delta_nll < e12.delta_nll
  assert all(isinstance(q, PathQuality) and q.tokens == full.tokens > 20 for q in (e24, e20, e12))


def test_a_bare_transformer_measures_token_ids_like_its_model(model):
  ids = [model.codec.encode(d) for d in DOCS]
  assert measure(model.module, PATHS[:2], ids, window=WINDOW) == measure(model, PATHS[:2], DOCS, window=WINDOW)
