"""Self-speculative decoding (thoughtjax/decode/speculative.py): greedy tokens identical to plain greedy decoding,
sampled tokens distributed as plain sampling (a statistical test that a wrong rule fails), stops,
max_tokens, cancellation, the trace's counts and the errors of drafts that cannot draft."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from scipy import stats

import thoughtjax
from tests.conftest import DEFAULT_MODEL_PROMPTS
from tests.tiny import TINY_CONFIGS, tiny_tokenizer
from thoughtjax.decode import speculative
from thoughtjax.decode.request import DecodeRequest
from thoughtjax.decode.speculative import Draft, DraftError
from thoughtjax.loading import LoadedModel
from thoughtjax.sampling import SamplingParams, stop_ids_for
from thoughtjax.thoughtlet import bridge as bridge_lib
from thoughtjax.transformer import init_random

PROMPTS = [[10, 20, 30, 40, 50], [7, 8, 9], list(range(40, 61))]


def _engine(seed: int = 5, scale: float = 0.3) -> thoughtjax.Model:
  """A 3-layer tiny model whose random weights are large enough that greedy text varies and the
  layers disagree (at the tests' default scale every layer predicts the same token)."""
  from thoughtjax.tokenizer import TextCodec

  cfg = TINY_CONFIGS["llama_gqa"]
  codec = TextCodec(tiny_tokenizer(), None, cfg.bos_id, cfg.eos_id)
  return thoughtjax.Model(LoadedModel(cfg, init_random(cfg, seed, scale=scale), codec, f"spec-{seed}", ""))


@pytest.fixture(scope="module")
def engine():
  return _engine()


def _bridge(cfg) -> dict:
  params = bridge_lib.init_params(cfg, rank=8, seed=1)
  params["up"] = 0.5 * np.asarray(bridge_lib.init_params(cfg, rank=8, seed=2)["down"]).T  # not the identity
  return params


DRAFTS = [
  ("exit1_k1", lambda cfg: "embed, blocks[0:1), head", 1),
  ("exit2_k3", lambda cfg: "embed, blocks[0:2), head", 3),
  ("exit1_recompute_k2", lambda cfg: Draft("embed, blocks[0:1), head", reuse=False), 2),
  ("exit1_bridge_k4", lambda cfg: Draft("embed, blocks[0:1), head", bridge=_bridge(cfg)), 4),
  ("full_truncated_vocab_k4", lambda cfg: Draft("embed, blocks[0:3), head", vocab=128), 4),
  # Weight variants: blocks of other weights keep a KV cache of their own.
  ("int8_full_k3", lambda cfg: "embed, blocks[0:3)@int8, head", 3),
  ("exit1_then_int8_k4", lambda cfg: "embed, blocks[0:1), blocks[1:3)@int8, head", 4),
  ("int8_exit2_truncated_vocab_k2", lambda cfg: Draft("embed, blocks[0:2)@int8, head", vocab=128), 2),
  # Drafts from the text itself (no weights): on this varied text they are mostly rejected.
  ("ngram3_k4", lambda cfg: "ngram:3", 4),
  ("ngram1_k2", lambda cfg: Draft.ngram(1), 2),
]


@pytest.mark.parametrize("make,k", [d[1:] for d in DRAFTS], ids=[d[0] for d in DRAFTS])
def test_greedy_is_token_identical_to_plain_greedy(engine, make, k):
  draft = make(engine.config)
  plain = [engine.generate(p, max_tokens=20, ignore_eos=True).token_ids for p in PROMPTS]
  assert len({tuple(t) for t in plain}) == 3 and all(len(set(t)) > 5 for t in plain)  # varied text
  one = engine.stream(PROMPTS[0], max_tokens=20, ignore_eos=True, draft=draft, draft_tokens=k)
  assert one.result().token_ids == plain[0]
  assert one.trace.verify_passes > 0 and one.trace.drafted == k * one.trace.verify_passes
  # A batch of 3 rows that accept different counts, with other max_tokens and a stop inside the text.
  stop = plain[1][7]
  params = [
    SamplingParams(max_tokens=20, ignore_eos=True),
    SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop,)),
    SamplingParams(max_tokens=13, ignore_eos=True),
  ]
  got = engine.generate_batch(PROMPTS, params, draft=draft, draft_tokens=k)
  assert got[0].token_ids == plain[0] and got[0].finish_reason == "length"
  assert got[1].token_ids == plain[1][: plain[1].index(stop) + 1] and got[1].finish_reason == "stop"
  assert got[2].token_ids == plain[2][:13] and got[2].finish_reason == "length"


def test_paths_of_one_shape_share_one_speculative_program(engine):
  """The speculative program is keyed by the shapes of the path and its draft: a second path of the same shape
  uses the first's program, and each stays token-identical to its own plain greedy text."""
  first, second = engine.with_path((0, 1, 1, 2)), engine.with_path((0, 2, 2, 1))  # both open on the draft's block
  params, stops = [SamplingParams(max_tokens=12, ignore_eos=True)], [[]]
  draft = "embed, blocks[0:1), head"
  a = speculative.prepare(first, DecodeRequest([PROMPTS[0]], params, stops), draft)
  b = speculative.prepare(second, DecodeRequest([PROMPTS[0]], params, stops), draft)
  assert a.program is b.program and a.key != b.key
  texts = []
  for m in (first, second):
    plain = m.generate(PROMPTS[0], max_tokens=12, ignore_eos=True).token_ids
    assert m.generate(PROMPTS[0], max_tokens=12, ignore_eos=True, draft=draft, draft_tokens=2).token_ids == plain
    texts.append(plain)
  assert texts[0] != texts[1]


def test_trace_counts_add_up(engine):
  g = engine.stream(PROMPTS[0], max_tokens=30, ignore_eos=True, draft="embed, blocks[0:2), head", draft_tokens=3)
  c = g.result()
  t = g.trace
  assert len(c.token_ids) == 30 and t.tokens_out == [30]
  assert t.drafted == 3 * t.verify_passes and 0 <= t.accepted <= t.drafted
  # One token from the prefill, then each pass appends its accepted drafts and one of the full path's (the
  # last pass may be cut by max_tokens).
  assert 30 - 1 <= t.accepted + t.verify_passes <= 30 - 1 + 3
  assert t.as_dict()["verify_passes"] == t.verify_passes


def test_eos_inside_an_accepted_run_ends_the_row(engine):
  eos = engine.config.eos_id
  bias = {eos: 100.0}  # every path, draft included, picks EOS: the first pass accepts it
  out = engine.generate([4, 5], max_tokens=6, logit_bias=bias, draft="embed, blocks[0:1), head", draft_tokens=3)
  assert out.token_ids == [eos] and out.finish_reason == "stop"
  out = engine.generate(
    [4, 5], max_tokens=6, logit_bias=bias, ignore_eos=True, draft="embed, blocks[0:1), head", draft_tokens=4
  )
  assert out.token_ids == [eos] * 6 and out.finish_reason == "length"


def test_cancel_ends_rows_at_the_next_chunk(engine):
  g = engine.with_chunk(1).stream(PROMPTS[0], max_tokens=40, ignore_eos=True, draft="embed, blocks[0:1), head")
  first = next(g)
  assert not first.finished
  g.cancel()
  rest = list(g)
  assert rest[-1].finished and rest[-1].finish_reason == "cancelled" and g.trace.cancelled
  assert len(g.completions()[0].token_ids) < 40


def test_an_int8_draft_has_caches_of_its_own_and_agrees_more_than_a_cut_path(engine):
  d = speculative.resolve_draft(engine, "embed, blocks[0:3)@int8, head")
  assert d.shared == 0 and d.own == 3 and not set(d.slots) & set(engine.layers)  # slots the full path does not use
  mixed = speculative.resolve_draft(engine, "embed, blocks[0:1), blocks[1:3)@int8, head")
  assert mixed.shared == 1 and mixed.own == 2 and mixed.slots[0] == engine.layers[0]
  req = speculative.prepare(
    engine, DecodeRequest([PROMPTS[0]], [SamplingParams(max_tokens=8)], [[]]), "embed, blocks[0:3)@int8, head"
  )
  state = jax.eval_shape(req.program._init_impl)
  assert len(state.draft_caches) == 3 and state.draft_caches[0][0].shape == state.rows.caches[0][0].shape

  def acceptance(draft):
    t = engine.stream(PROMPTS[2], max_tokens=40, ignore_eos=True, draft=draft, draft_tokens=4)
    t.completions()
    return t.trace.accepted / t.trace.drafted

  assert acceptance("embed, blocks[0:3)@int8, head") > acceptance("embed, blocks[0:2), head")


def test_a_speculative_generation_compiles_its_program_once(engine, caplog):
  """The prefill call compiles the program and every decode chunk reuses it: the first state is committed to
  the device of the weights, like the states advance returns (an uncommitted one compiled it twice)."""
  import logging
  import re

  import jax

  # Weights committed to one device, as a registry restores them; a key no other test uses (K=5, chunk 2).
  model = engine.with_chunk(2)
  model = model.with_path(model.layers, jax.device_put(model.parts, jax.devices()[0]))
  with caplog.at_level(logging.WARNING), jax.log_compiles(True):
    g = model.stream(PROMPTS[0], max_tokens=24, ignore_eos=True, draft="embed, blocks[0:2), head", draft_tokens=5)
    tokens = g.completions()[0].token_ids
  # The program is jit(_advance_impl), or jit(call) when it runs as an exported program (thoughtjax.exported).
  compiles = [
    r for r in caplog.records if re.match(r"Finished XLA compilation of jit\((_advance_impl|call)\)", r.getMessage())
  ]
  assert len(tokens) == 24 and g.trace.decode_chunks >= 2 and g.trace.compile_s > 0
  assert len(compiles) == 1, [r.getMessage()[:120] for r in compiles]
  assert tokens == model.generate(PROMPTS[0], max_tokens=24, ignore_eos=True).token_ids


@pytest.mark.parametrize(
  "draft,words",
  [
    ("embed, blocks[1:2), head", ["not the first blocks", "blocks[1:2)", "embed, blocks[0:1), head"]),
    ("embed, blocks[0:1), blocks[2:3), head", ["not the first blocks"]),
    ("blocks[0:1), head", ["start with embed"]),
    ("embed, blocks[0:3), head", ["full path itself"]),
    (Draft("embed, blocks[0:1), head", vocab=10**6), ["vocab", "[1, 259]"]),
    ("ngram:0", ["'ngram:0'", "[1, 16]", "got '0'", "'ngram:3'"]),
    ("ngram:17", ["[1, 16]", "got '17'"]),
    ("ngram:three", ["[1, 16]", "got 'three'"]),
    ("ngram:3:4", ["shortest match", "[1, 3]", "got '4'", "'ngram:3:2'"]),
    ("ngram:3:2:1", ["'ngram:N:M'", "got '3:2:1'"]),
    (Draft("ngram:2", vocab=100), ["looks its tokens up in the text", "vocab=100", "drop them"]),
  ],
)
def test_a_draft_that_cannot_draft_is_a_named_user_error(engine, draft, words):
  with pytest.raises(DraftError) as err:
    engine.generate(PROMPTS[0], max_tokens=4, draft=draft)
  assert isinstance(err.value, thoughtjax.errors.UserError)
  for w in words:
    assert w in str(err.value)


def test_draft_tokens_out_of_range_and_callback_streaming_are_refused(engine):
  with pytest.raises(DraftError, match="draft_tokens"):
    engine.generate(PROMPTS[0], max_tokens=4, draft="embed, blocks[0:1), head", draft_tokens=0)
  with pytest.raises(thoughtjax.errors.UserError, match="stream_mode"):
    engine.generate(PROMPTS[0], max_tokens=4, draft="embed, blocks[0:1), head", stream_mode="callback")


# ---- sampling: the output distribution is the full path's ------------------------------------------------
ALLOWED = [7, 129, 151, 81]  # the only tokens with non-negligible mass (a large logit bias), 4**3 outcomes
PROMPT = [10, 20, 30, 40, 50]
SAMPLES = 2048
ROWS = 64


def _exact_joint(engine, params: SamplingParams, prompt=PROMPT) -> dict[tuple[int, ...], float]:
  """P(t1, t2, t3) of plain sampling, from the full path's logits under the same bias and temperature."""
  bias = np.zeros(engine.config.vocab_size)
  for t, b in params.logit_bias.items():
    bias[t] = b

  def probs(prefix):
    x = (engine.logits(prefix)[-1] + bias) / params.temperature
    p = np.exp(x - x.max())
    return p / p.sum()

  joint = {}
  for seq in itertools.product(ALLOWED, repeat=3):
    pr, prefix = 1.0, list(prompt)
    for t in seq:
      pr *= probs(prefix)[t]
      prefix.append(t)
    joint[seq] = pr
  return joint


def _samples(engine, params_of, accept, draft="embed, blocks[0:1), head", prompt=PROMPT) -> list[tuple[int, ...]]:
  out = []
  for first in range(0, SAMPLES, ROWS):
    params = [params_of(seed) for seed in range(first, first + ROWS)]
    stops = [stop_ids_for(p, engine.codec.eos_ids) for p in params]
    g = speculative.stream_batch(
      engine, DecodeRequest([prompt] * ROWS, params, stops), 0.0, draft, draft_tokens=2, accept=accept
    )
    out += [tuple(c.token_ids) for c in g.completions()]
  return out


def _chi_square_p(samples, joint) -> float:
  """p-value of the samples against the exact joint; outcomes expected fewer than 5 times are pooled."""
  counts = {seq: 0 for seq in joint}
  for s in samples:
    counts[s] = counts.get(s, 0) + 1  # an outcome outside ALLOWED gets its own cell with ~0 expected
  total = sum(joint.values())
  obs, exp, pool_obs, pool_exp = [], [], 0, 0.0
  for seq, c in counts.items():
    e = len(samples) * joint.get(seq, 0.0) / total
    if e < 5:
      pool_obs, pool_exp = pool_obs + c, pool_exp + e
    else:
      obs.append(c)
      exp.append(e)
  obs.append(pool_obs)
  exp.append(max(pool_exp, 1e-9))
  return float(stats.chisquare(obs, np.asarray(exp) * len(samples) / sum(exp)).pvalue)


def test_sampling_keeps_the_full_paths_distribution_and_a_wrong_rule_fails(engine):
  def params_of(seed):
    return SamplingParams(
      max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True, logit_bias={t: 30.0 for t in ALLOWED}
    )

  joint = _exact_joint(engine, params_of(0))
  right = _samples(engine, params_of, "speculative")
  wrong = _samples(engine, params_of, "always")  # accept every draft: tokens 2 and 3 follow the draft's q
  assert all(len(s) == 3 for s in right + wrong)
  p_right, p_wrong = _chi_square_p(right, joint), _chi_square_p(wrong, joint)
  assert p_right > 1e-3, f"speculative sampling departs from the full path's distribution: p={p_right:.2e}"
  assert p_wrong < 1e-6, f"the check cannot tell a wrong rule (accept always) apart: p={p_wrong:.2e}"
  assert len(set(right)) > 20  # many outcomes, not a constant


def test_sampling_with_top_k_top_p_and_truncated_draft_vocab_is_reproducible(engine):
  kw = dict(max_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=3, ignore_eos=True)
  draft = Draft("embed, blocks[0:2), head", vocab=200)
  a = engine.generate(PROMPTS[0], draft=draft, draft_tokens=3, **kw).token_ids
  assert a == engine.generate(PROMPTS[0], draft=draft, draft_tokens=3, **kw).token_ids
  assert len(a) == 12
  plain_top = set()
  for seed in range(8):  # every token lies in the top-k support of the full path
    plain_top |= set(engine.generate(PROMPTS[0], **{**kw, "seed": seed}).token_ids)
  assert a[0] in plain_top  # the prefill's token is the plain program's own


@pytest.mark.slow
def test_default_model_greedy_speculation_is_identical_to_plain_greedy(default_model):
  # The exactness prompts as one batch (rows of different lengths, left-padded), under four drafts: the exit-24 cut,
  # the n-gram lookup, a short cut with a truncated vocabulary and the int8 weight variant (its own KV cache). One
  # batch compiles each speculative program once instead of once per prompt bucket. Speculation sees token ids only,
  # so the non-ASCII prompt (a bucket of its own, 35 s of compiles) adds nothing the others don't.
  prompts = [(label, text) for label, text in DEFAULT_MODEL_PROMPTS if label != "non_ascii"]
  assert len(prompts) == 3
  ids = [
    default_model.prompt_ids("What is the capital of France?", chat=True)
    if text is None
    else default_model.prompt_ids(text)
    for _, text in prompts
  ]
  params = SamplingParams(max_tokens=32)
  plain = [c.token_ids for c in default_model.generate_batch(ids, params)]
  drafts = (
    ("embed, blocks[0:24), head", 4),
    ("ngram:3", 4),  # no weights
    (Draft("embed, blocks[0:8), head", vocab=8192), 3),
    ("embed, blocks[0:30)@int8, head", 4),  # a weight variant: its own KV cache
  )
  for draft, k in drafts:
    got = [c.token_ids for c in default_model.generate_batch(ids, params, draft=draft, draft_tokens=k)]
    for (label, _), g, want in zip(prompts, got, plain, strict=True):
      assert g == want, f"{label}: draft {draft} K={k} gave {g}, plain greedy {want}"


def test_cli_generate_with_a_draft_prints_the_plain_tokens_and_the_counts(tmp_path, capsys):
  import json

  from tests.tiny import tiny_model, write_safetensors_dir
  from thoughtjax import cli

  cfg, model = tiny_model("llama_gqa", seed=2)
  directory = write_safetensors_dir(tmp_path / "model", cfg, model)
  base = ["generate", "--model", str(directory), "--prompt", "hello", "--max-tokens", "8", "--json"]
  assert cli.main(base) == 0
  plain = json.loads(capsys.readouterr().out)
  assert cli.main([*base, "--draft", "embed, blocks[0:1), head", "--draft-tokens", "2"]) == 0
  spec = json.loads(capsys.readouterr().out)
  assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
  assert spec["drafted"] == 2 * spec["verify_passes"] > 0
  assert cli.main([*base, "--draft", "embed, blocks[2:3), head"]) == 2
  err = capsys.readouterr().err
  assert "embed, blocks[2:3), head" in err and "first k blocks" in err
  assert cli.main([*base, "--draft-tokens", "3"]) == 2
  assert "--draft PATH" in capsys.readouterr().err


def test_draft_and_verify_run_in_one_program_with_no_host_callbacks(engine):
  """The decode chunk is a while loop inside one XLA program: a draft loop and a verify pass per iteration,
  and no host round trip between them."""
  params = [SamplingParams(max_tokens=8, temperature=1.0)]
  stops = [stop_ids_for(params[0], engine.codec.eos_ids)]
  req = speculative.prepare(
    engine, DecodeRequest([PROMPTS[0]], params, stops), "embed, blocks[0:2), head", draft_tokens=3
  )
  hlo = req.program.lower(req.inputs).as_text()
  assert "callback" not in hlo.lower()
  assert hlo.count("stablehlo.while") >= 2  # the decode loop and the draft loop inside it


# ---- drafts from the text itself (n-gram / prompt lookup) ----------------------------------------------------
def test_ngram_lookup_takes_the_longest_latest_match_and_repeats_its_period():
  import jax.numpy as jnp

  hist = jnp.asarray(
    [
      [0, 0, 5, 6, 7, 5, 6, 7, 5, 6],  # padded by 2: "7 5 6" ended at 6, continues 7 5 6, then its period 7
      [0, 1, 2, 3, 4, 5, 6, 7, 8, 9],  # 9 never occurred before: the last token K times
      [9, 9, 9, 9, 9, 9, -1, -1, -1, -1],  # history ends at 5: the period-1 run, nothing read past the end
      [1, 2, 3, 8, 5, 3, 9, 2, 3, -1],  # "2 3" (ended at 2) beats the later "3" (at 5): the longest match first
      [3, 3, 0, 0, 0, 0, 0, 0, 1, 3],  # the padding (3 3 before start 2) is not history: no match
    ],
    jnp.int32,
  )
  start, end = jnp.asarray([2, 1, 0, 0, 2]), jnp.asarray([9, 9, 5, 8, 9])
  got, matched = speculative.ngram_proposal(hist, start, end, 3, 4)
  assert np.asarray(got).tolist() == [[7, 5, 6, 7], [9, 9, 9, 9], [9, 9, 9, 9], [8, 5, 3, 9], [3, 3, 3, 3]]
  assert np.asarray(matched).tolist() == [3, 0, 3, 2, 0]
  # With n = 1 only the last token is matched: its latest earlier occurrence wins.
  got, matched = speculative.ngram_proposal(hist, start, end, 1, 2)
  assert np.asarray(got)[3].tolist() == [9, 2] and np.asarray(matched).tolist() == [1, 0, 1, 1, 0]


@pytest.fixture(scope="module")
def repetitive():
  """A tiny model whose greedy text runs in repeats (small weights): n-gram drafts are often accepted."""
  return _engine(5, scale=0.1)


def test_ngram_greedy_is_token_identical_where_the_text_repeats(repetitive):
  prompts = [PROMPTS[0], [5, 6, 7, 8] * 4, list(range(40, 61))]
  plain = [repetitive.generate(p, max_tokens=32, ignore_eos=True).token_ids for p in prompts]
  g = repetitive.stream(prompts[0], max_tokens=32, ignore_eos=True, draft="ngram:3", draft_tokens=4)
  assert g.result().token_ids == plain[0]
  t = g.trace
  assert t.drafted == 4 * t.verify_passes and t.accepted >= 8  # most of the text came from accepted drafts
  assert t.verify_passes < 31 and t.accepted < t.drafted  # and some were rejected where a run ends
  stop = plain[1][9]
  params = [
    SamplingParams(max_tokens=32, ignore_eos=True),
    SamplingParams(max_tokens=32, ignore_eos=True, stop_token_ids=(stop,)),
    SamplingParams(max_tokens=11, ignore_eos=True),
  ]
  for draft, k in (("ngram:3", 4), ("ngram:1", 3), ("ngram:2", 8), ("ngram:3:2", 4)):
    got = repetitive.generate_batch(prompts, params, draft=draft, draft_tokens=k)
    assert got[0].token_ids == plain[0] and got[0].finish_reason == "length"
    assert got[1].token_ids == plain[1][: plain[1].index(stop) + 1] and got[1].finish_reason == "stop"
    assert got[2].token_ids == plain[2][:11] and got[2].finish_reason == "length"


NGRAM_PROMPT = [7, 129, 151, 81, 7, 129]  # the allowed tokens: "7 129" recurs, so drafts propose them


def test_ngram_sampling_keeps_the_full_paths_distribution_and_wrong_rules_fail(engine):
  """A one-hot proposal: accept d with probability p(d), on rejection draw from p without d. Two wrong rules
  must fail the same check: accepting every draft, and redrawing from p itself on a rejection."""

  def params_of(seed):
    return SamplingParams(
      max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True, logit_bias={t: 30.0 for t in ALLOWED}
    )

  joint = _exact_joint(engine, params_of(0), NGRAM_PROMPT)
  stops = [stop_ids_for(params_of(s), engine.codec.eos_ids) for s in range(ROWS)]
  g = speculative.stream_batch(
    engine,
    DecodeRequest([NGRAM_PROMPT] * ROWS, [params_of(s) for s in range(ROWS)], stops),
    0.0,
    "ngram:2",
    draft_tokens=2,
  )
  g.completions()
  assert 0 < g.trace.accepted < g.trace.drafted  # both the accepting and the rejecting branch ran
  right, always, resample = (
    _samples(engine, params_of, rule, "ngram:2", NGRAM_PROMPT) for rule in ("speculative", "always", "resample")
  )
  assert all(len(s) == 3 for s in right + always + resample)
  p_right = _chi_square_p(right, joint)
  assert p_right > 1e-3, f"n-gram speculative sampling departs from the full path's distribution: p={p_right:.2e}"
  for name, wrong in (("always", always), ("resample", resample)):
    p_wrong = _chi_square_p(wrong, joint)
    assert p_wrong < 1e-6, f"the check cannot tell the wrong rule {name!r} apart: p={p_wrong:.2e}"
  assert len(set(right)) > 20


def test_an_ngram_draft_runs_in_one_program_without_draft_weights(engine):
  params = [SamplingParams(max_tokens=8, temperature=1.0)]
  stops = [stop_ids_for(params[0], engine.codec.eos_ids)]
  req = speculative.prepare(engine, DecodeRequest([PROMPTS[0]], params, stops), "ngram", draft_tokens=3)
  key = req.program.key
  assert key.ngram == speculative.NGRAM_DEFAULT and key.draft == () and key.shared == 0 and key.own == 0
  hlo = req.program.lower(req.inputs).as_text()
  assert "callback" not in hlo.lower() and hlo.count("stablehlo.while") >= 1


def test_cli_generate_with_an_ngram_draft_prints_the_plain_tokens(tmp_path, capsys):
  import json

  from tests.tiny import tiny_model, write_safetensors_dir
  from thoughtjax import cli

  cfg, model = tiny_model("llama_gqa", seed=2)
  directory = write_safetensors_dir(tmp_path / "model", cfg, model)
  base = ["generate", "--model", str(directory), "--prompt", "hello hello hello", "--max-tokens", "8", "--json"]
  assert cli.main(base) == 0
  plain = json.loads(capsys.readouterr().out)
  assert cli.main([*base, "--draft", "ngram:2", "--draft-tokens", "3"]) == 0
  spec = json.loads(capsys.readouterr().out)
  assert spec["token_ids"] == plain["token_ids"] and spec["drafted"] == 3 * spec["verify_passes"] > 0
  assert cli.main([*base, "--draft", "ngram:99"]) == 2
  assert "[1, 16]" in capsys.readouterr().err


def test_without_a_long_enough_match_an_ngram_iteration_is_a_plain_step(engine):
  """'ngram:3:3' drafts only after a repeated 3-gram: on varied text nearly every iteration is a plain
  one-token step (no draft counted, no verify pass), and the tokens are still plain greedy's."""
  plain = engine.generate(PROMPTS[2], max_tokens=20, ignore_eos=True).token_ids
  g = engine.stream(PROMPTS[2], max_tokens=20, ignore_eos=True, draft="ngram:3:3", draft_tokens=4)
  assert g.result().token_ids == plain
  t = g.trace
  assert t.drafted == 4 * t.verify_passes and t.verify_passes <= 2 and t.accepted <= t.drafted
  loose = engine.stream(PROMPTS[2], max_tokens=20, ignore_eos=True, draft="ngram:3", draft_tokens=4)
  assert loose.result().token_ids == plain and loose.trace.verify_passes > t.verify_passes  # any match drafts
  assert speculative.resolve_draft(engine, Draft.ngram(3, min_match=2)).label == "ngram:3:2"
