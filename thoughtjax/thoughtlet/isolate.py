"""Isolate and replay: capture a thoughtlet's input and output inside the whole model's forward
pass, run the thoughtlet alone on that input, and compare.

>>> import thoughtjax
>>> from thoughtjax.thoughtlet import capture, replay
>>> model = thoughtjax.load()
>>> report = replay(model, "blocks[3:5)", "The capital of France is")
>>> report.max_abs_diff                    # 0.0 on CPU: same module code, same numbers
>>> report.captured.shape                  # (1, T, 576): the residual after layer 4
>>> replay(model, "template", "Hi!").ok()  # the chat prompt's embed rows from the message alone
>>> replay(model, registry.thoughtlet("blocks[0:10)"), "Hi")  # a published version, same test

:func:`capture` runs the model's own ``forward`` (a causal pass from empty caches) with each
part (embed, every block, head) wrapped by a recorder; the model and its classes are not
changed, so it is safe next to other threads using the same model. :func:`replay` then runs the
thoughtlet by itself (:mod:`thoughtjax.thoughtlet.run`) on what its first part received and
compares with what its last part produced. A thoughtlet is named (``embed``, ``head``,
``template``, ``blocks[a:b)``: cut from the model) or given as a :class:`Thoughtlet`, e.g. one
restored from a registry, whose own weights are replayed. A ``template`` replays from the user
message's tokens alone against the embed output of the whole chat prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from thoughtjax.decode.layout import causal
from thoughtjax.thoughtlet.errors import ThoughtletError
from thoughtjax.thoughtlet.run import causal_setup, run_blocks, run_embed, run_head, run_template
from thoughtjax.thoughtlet.slicing import as_state, cut, template_parts, unit_of
from thoughtjax.thoughtlet.types import Kind, Thoughtlet
from thoughtjax.transformer import GraphDefs, abstract_model

Pair = tuple[np.ndarray, np.ndarray]  # (what a part received, what it produced)


@dataclasses.dataclass(frozen=True, eq=False)
class Capture:
  """Every part's input and output during one causal forward of the whole model."""

  tokens: np.ndarray  # [B, T] i32
  embed: Pair  # tokens [B, T] -> residual [B, T, D]
  blocks: tuple[Pair, ...]  # per layer l: residual [B, T, D] in -> out
  head: Pair  # residual [B, T, D] -> logits [B, T, V]
  logits: np.ndarray  # [B, T, V] f32: what the whole forward returned


@dataclasses.dataclass(frozen=True, eq=False)
class ReplayReport:
  """One thoughtlet run alone on its captured input, beside what the whole model computed there."""

  name: str
  kind: Kind
  input: np.ndarray  # [B, T] tokens, [B, U] message tokens or [B, T, D] residual
  captured: np.ndarray  # inside the whole model
  replayed: np.ndarray  # the thoughtlet alone
  max_abs_diff: float

  def ok(self, atol: float = 1e-5) -> bool:
    return self.captured.shape == self.replayed.shape and self.max_abs_diff <= atol

  def __str__(self) -> str:
    return (
      f"replay {self.name}: {tuple(self.input.shape)} -> {tuple(self.replayed.shape)}, "
      f"max |alone - in model| = {self.max_abs_diff:.3g}"
    )


class _Recorder:
  """Stands in for one part while the model runs: calls it and records (input, output)."""

  def __init__(self, part, records: list):
    self._part, self._records = part, records

  def __getattr__(self, name):  # everything else (weights, config) is the part's own
    return getattr(self._part, name)

  def __call__(self, x, *args, **kwargs):
    out = self._part(x, *args, **kwargs)
    self._records.append((np.asarray(x), np.asarray(out[0] if isinstance(out, tuple) else out)))
    return out


class _Recorded:
  """The model's attributes with each part behind a recorder; the model itself is untouched."""

  def __init__(self, module, records: dict[str, list]):
    self._module = module
    self.embed = _Recorder(module.embed, records["embed"])
    self.blocks = [_Recorder(b, records["blocks"]) for b in module.blocks]
    self.head = _Recorder(module.head, records["head"])

  def __getattr__(self, name):
    return getattr(self._module, name)


def _module(model):
  """The NNX Transformer of a loaded Model, or the Transformer itself; it must hold real weights."""
  module = getattr(model, "module", model)
  if not isinstance(module.embed.table.get_value(), jax.Array):
    raise ThoughtletError(
      "this model holds no whole-model weights (a path composed from a registry holds only "
      "its parts); replay inside the loaded source model instead: "
      "replay(thoughtjax.load(source), registry.thoughtlet(name), prompt)"
    )
  return module


def capture(model, tokens) -> Capture:
  """Inputs and outputs of every part during one causal forward of ``model`` over ``tokens`` [B, T]."""
  module = _module(model)
  tokens = np.asarray(tokens, np.int32)
  tokens = jnp.asarray(tokens[None] if tokens.ndim == 1 else tokens)
  B, T = tokens.shape
  records: dict[str, list] = {"embed": [], "blocks": [], "head": []}
  caches, write_at, mask = causal_setup(module.cfg, B, T, module.cfg.num_layers)
  positions = causal(B, T)[0]
  logits, _ = type(module).forward(_Recorded(module, records), tokens, positions, caches, write_at, mask)
  if len(records["blocks"]) != module.cfg.num_layers or len(records["embed"]) != 1 or len(records["head"]) != 1:
    raise RuntimeError(
      f"capture saw {len(records['embed'])} embed, {len(records['blocks'])} block and "
      f"{len(records['head'])} head calls; expected 1, {module.cfg.num_layers} and 1. "
      f"The model's forward no longer calls its parts once each"
    )
  return Capture(
    np.asarray(tokens), records["embed"][0], tuple(records["blocks"]), records["head"][0], np.asarray(logits)
  )


# ------------------------------------------------------------------------------ the kinds
@dataclasses.dataclass(frozen=True)
class _Alone:
  """What running a thoughtlet alone needs besides its params."""

  defs: GraphDefs
  abstract: object  # a weightless Transformer: the NNX state structure of each part
  table: object  # [V, D] embed table, for a tied head and a template
  user: list[int] | None  # the message tokens of a template replay
  implementation: str | None


def _embed(cap: Capture, params, layers, a: _Alone):
  x, want = cap.embed
  return x, want, run_embed(a.defs, as_state(a.abstract.embed, params), jnp.asarray(x))


def _blocks(cap: Capture, params, layers, a: _Alone):
  lo, hi = layers
  x, want = cap.blocks[lo][0], cap.blocks[hi - 1][1]
  states = [as_state(a.abstract.blocks[i], params[str(i)]) for i in range(lo, hi)]
  return x, want, run_blocks(a.defs, a.abstract.cfg, states, jnp.asarray(x))[0]


def _head(cap: Capture, params, layers, a: _Alone):
  x, want = cap.head
  return x, want, run_head(a.defs, as_state(a.abstract.head, params), jnp.asarray(x), a.table)


def _template(cap: Capture, params, layers, a: _Alone):
  user = np.asarray([a.user], np.int32)
  got = run_template(
    params,
    a.table,
    jnp.asarray(user),
    jnp.asarray([user.shape[1]], jnp.int32),
    total_len=cap.tokens.shape[1],
    left_pad=False,
    implementation=a.implementation,
  )
  return user, cap.embed[1], got


_KINDS: dict[Kind, Callable] = {Kind.EMBED: _embed, Kind.BLOCKS: _blocks, Kind.HEAD: _head, Kind.TEMPLATE: _template}


# ------------------------------------------------------------------------------ the tool
def _unit(module, unit: str | Thoughtlet, codec, system) -> tuple[str, Kind, tuple | None, Mapping]:
  """(name, kind, layers, params) of a named unit cut from the model, or of a given thoughtlet."""
  if isinstance(unit, Thoughtlet):
    if unit.config.family_hash != module.cfg.family_hash:
      raise ThoughtletError(
        f"{unit.name}: cut from a model of family {unit.config.family_hash}, but the model "
        f"replayed is family {module.cfg.family_hash}; replay it inside the model it was cut from"
      )
    kind, layers, params = unit.kind, unit.layers, unit.params
    if kind is Kind.BLOCKS and layers[1] > module.cfg.num_layers:
      raise ThoughtletError(f"{unit.name}: layers {layers} run past the model's {module.cfg.num_layers} layers")
    return unit.name, kind, layers, params
  kind, layers = unit_of(unit)
  return unit, kind, layers, cut(module, kind, layers=layers, codec=codec, system=system)


def _prompt(codec, prompt, kind: Kind, chat: bool, system: str | None) -> tuple[list[int], list[int] | None]:
  """(token ids of the whole prompt, the user message's ids for a template replay)."""
  if kind is not Kind.TEMPLATE and not isinstance(prompt, str):
    return [int(t) for t in prompt], None
  if codec is None:
    raise ThoughtletError("a text prompt needs the model's codec; replay a loaded Model or pass codec=")
  if kind is Kind.TEMPLATE and not isinstance(prompt, str):
    raise ThoughtletError(f"a template replays from a user message; expected a str, got {type(prompt).__name__}")
  if not (chat or kind is Kind.TEMPLATE):
    return codec.encode(prompt), None
  messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
  tokens = codec.encode(codec.render_chat(messages))
  if kind is not Kind.TEMPLATE:
    return tokens, None
  user = codec.tokenizer.encode(prompt, add_special_tokens=False).ids
  prefix, suffix = template_parts(codec, system)
  if not user or prefix + user + suffix != tokens:
    raise ThoughtletError(
      f"the message {prompt!r} does not tokenize the same alone as inside the chat prompt "
      f"(or is empty); pick a message that does, e.g. one that starts and ends with a letter"
    )
  return tokens, user


def replay(
  model,
  unit: str | Thoughtlet,
  prompt: str | Sequence[int],
  *,
  chat: bool = False,
  system: str | None = None,
  table=None,
  codec=None,
  implementation: str | None = None,
) -> ReplayReport:
  """Run one thoughtlet alone on the input it receives inside ``model``; compare with its output there.

  ``model``: a loaded :class:`~thoughtjax.model.Model` (``thoughtjax.load()``) or a bare Transformer
  (pass ``codec=`` for text prompts). ``unit``: ``"embed"``, ``"head"``, ``"template"``, ``"blocks[a:b)"``
  or a :class:`Thoughtlet` (its own weights are replayed). ``prompt``: text (``chat=True`` renders
  it as one user message) or token ids; a template takes the user message as text. ``table``: the
  [V, D] embed table a tied head or a template reads (default: the model's own).
  """
  module = _module(model)
  codec = codec if codec is not None else getattr(model, "codec", None)
  name, kind, layers, params = _unit(module, unit, codec, system)
  tokens, user = _prompt(codec, prompt, kind, chat, system)
  if not tokens:
    raise ThoughtletError(f"replay {name}: the prompt has no tokens; give at least one")
  cap = capture(module, tokens)
  abstract = abstract_model(module.cfg)
  alone = _Alone(
    GraphDefs.from_model(module), abstract, module.embed.table[...] if table is None else table, user, implementation
  )
  x, want, got = _KINDS[kind](cap, params, layers, alone)
  got = np.asarray(got)
  diff = float(np.max(np.abs(got - want))) if got.shape == want.shape else float("inf")
  return ReplayReport(name, kind, np.asarray(x), want, got, diff)
