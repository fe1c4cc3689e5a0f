"""Thoughtlets: named, typed, measured, hashable units cut from a model.

A :class:`Thoughtlet` is one of

* ``embed``      tokens[B,T] i32 -> residual[B,T,D] f32 (the embedding table);
* ``blocks[a:b)`` residual -> residual (decoder layers a..b-1, half-open);
* ``head``       residual[B,T,D] -> logits[B,T,V] f32 (final norm + LM head; a tied
  head reads the embed thoughtlet's table);
* ``template``   message[B,U] i32 -> residual[B,T,D] (precomputed embedding rows of a
  chat template's fixed parts around the user's tokens; reads the embed table).

Its :class:`SemanticSignature` types the input and output so a path type-checks link by link.
Its :class:`ResourceProfile` is measured, not guessed (XLA's cost and memory analyses, timed
decode steps). Its ``versioned_hash`` is SHA3-512 over :func:`canonical_json` of the identity
followed by every weight (path, dtype, shape, little-endian bytes) in sorted path order.

One concept per module:

* :mod:`~thoughtjax.thoughtlet.types`    Kind, TensorType, SemanticSignature, signature_for, Thoughtlet
* :mod:`~thoughtjax.thoughtlet.hashing`  canonical_json, flat_params, param_spec, versioned_hash
* :mod:`~thoughtjax.thoughtlet.slicing`  :func:`cut` (the one slicer), as_state, block_states
* :mod:`~thoughtjax.thoughtlet.run`      run_embed, run_blocks, run_head, run_template (one alone)
* :mod:`~thoughtjax.thoughtlet.resource_profile`  ResourceProfile (what a measurement records)
* :mod:`~thoughtjax.thoughtlet.profile`  ProfileSettings, fingerprint, measure_profile (how it is measured)
* :mod:`~thoughtjax.thoughtlet.isolate`  :func:`capture` and :func:`replay` (isolate and replay)
"""

from thoughtjax.thoughtlet.errors import ThoughtletError
from thoughtjax.thoughtlet.hashing import HASH_DOMAIN, canonical_json, flat_params, param_spec, versioned_hash
from thoughtjax.thoughtlet.isolate import Capture, ReplayReport, capture, replay
from thoughtjax.thoughtlet.profile import ProfileSettings, fingerprint, measure_profile
from thoughtjax.thoughtlet.resource_profile import ResourceProfile
from thoughtjax.thoughtlet.run import causal_setup, run_blocks, run_embed, run_head, run_template
from thoughtjax.thoughtlet.slicing import as_state, block_states, cut, defs_for, template_parts, unit_of
from thoughtjax.thoughtlet.types import Kind, SemanticSignature, TensorType, Thoughtlet, residual_type, signature_for

__all__ = [
  "HASH_DOMAIN",
  "Capture",
  "Kind",
  "ProfileSettings",
  "ReplayReport",
  "ResourceProfile",
  "SemanticSignature",
  "TensorType",
  "Thoughtlet",
  "ThoughtletError",
  "as_state",
  "block_states",
  "canonical_json",
  "capture",
  "causal_setup",
  "cut",
  "defs_for",
  "fingerprint",
  "flat_params",
  "measure_profile",
  "param_spec",
  "replay",
  "residual_type",
  "run_blocks",
  "run_embed",
  "run_head",
  "run_template",
  "signature_for",
  "template_parts",
  "unit_of",
  "versioned_hash",
]
