"""Both kernels cross-lower for CUDA through Pallas' Triton backend, from any machine.

A change that breaks GPU lowering (a gather, a ``jnp.any``, a non-power-of-two
block, a missing Triton compiler param that lets JAX pick Mosaic GPU) fails here
on the CPU-only CI. With jaxlib <= 0.10.2 lowering needs no GPU and no CUDA plugin:
the Triton IR is built by jaxlib's bundled MLIR dialects and shipped inside a
custom call. Later jaxlibs compile the IR to PTX at lowering time through a Triton
compilation handler that the CUDA plugin registers; ``lower_for_cuda`` says so.
"""

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest

from thoughtjax.kernels.sample_stop import mask_words, sample_stop
from thoughtjax.kernels.template_embed import template_embed

B, V, T, U = 64, 49152, 256, 200
TRITON_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")
# Primitives without a Triton lowering or that would be a hidden gather/scatter.
FORBIDDEN = {"gather", "scatter", "reduce_or", "reduce_and", "sort", "argsort"}


def _sample_stop_case(dtype, num_stop, with_bias, num_rows=B, vocab=V, with_allowed=False):
  def f(logits, temperature, top_k, seed, step, stop_ids, bias, allowed):
    return sample_stop(
      logits,
      temperature=temperature,
      top_k=top_k,
      seed=seed,
      step=step,
      stop_ids=stop_ids,
      logit_bias=bias if with_bias else None,
      allowed=allowed if with_allowed else None,
      implementation="pallas",
      interpret=False,
    )

  sds = jax.ShapeDtypeStruct
  return f, (
    sds((num_rows, vocab), dtype),
    sds((num_rows,), jnp.float32),
    sds((num_rows,), jnp.int32),
    sds((num_rows,), jnp.uint32),
    sds((), jnp.int32),
    sds((num_rows, num_stop), jnp.int32),
    sds((num_rows, vocab), jnp.float32),
    sds((num_rows, mask_words(vocab)), jnp.uint32),
  )


def _template_embed_case(dim, dtype, prefix_len, left_pad):
  def f(prefix, suffix, table, ids, lengths):
    return template_embed(
      prefix, suffix, table, ids, lengths, total_len=T, left_pad=left_pad, implementation="pallas", interpret=False
    )

  sds = jax.ShapeDtypeStruct
  return f, (
    sds((prefix_len, dim), dtype),
    sds((5, dim), dtype),
    sds((V, dim), dtype),
    sds((B, U), jnp.int32),
    sds((B,), jnp.int32),
  )


CASES = {
  "sample_stop-f32-bias-stop8": _sample_stop_case(jnp.float32, 8, True),
  "sample_stop-bf16-nostop-B1": _sample_stop_case(jnp.bfloat16, 0, False, num_rows=1),
  "sample_stop-f32-stop256": _sample_stop_case(jnp.float32, 256, False),
  # The allowed-token mask: the words of a 2048-token block, and a block (V=12) inside one word.
  "sample_stop-f32-bias-mask-stop8": _sample_stop_case(jnp.float32, 8, True, with_allowed=True),
  "sample_stop-bf16-mask-B1-V12": _sample_stop_case(jnp.bfloat16, 0, False, num_rows=1, vocab=12, with_allowed=True),
  "template_embed-576-f32": _template_embed_case(576, jnp.float32, 16, False),
  "template_embed-4096-bf16-leftpad-noprefix": _template_embed_case(4096, jnp.bfloat16, 0, True),
}


def lower_for_cuda(f, args):
  try:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  except RuntimeError as e:
    if "Triton compilation handler" not in str(e):
      raise
    pytest.fail(
      f"{e}: this jaxlib ({jax.__version__}) compiles Triton while lowering; install "
      "the jax CUDA plugin (jax-cuda12-plugin) so it registers the handler, or pin "
      "jaxlib 0.10.2 where cross-lowering needs nothing extra"
    )


def _custom_calls(module):
  found = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for child in block.operations:
          if child.operation.name == "stablehlo.custom_call":
            found.append(child.operation)
          walk(child.operation)

  walk(module.operation)
  return found


def _kernel_jaxprs(f, args):
  """The jaxpr of every pallas_call kernel in f, with nested sub-jaxprs."""
  kernels = []

  def collect(jaxpr, inside_kernel):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        kernels.append(eqn.params["jaxpr"])
        continue
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        collect(sub, inside_kernel)

  collect(jax.make_jaxpr(f)(*args).jaxpr, False)
  return kernels


def _all_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _all_eqns(sub)


@pytest.mark.parametrize("name", CASES)
def test_lowers_for_cuda_through_triton(name):
  f, args = CASES[name]
  lowered = lower_for_cuda(f, args)
  targets = [
    str(op.attributes["call_target_name"]).strip('"') for op in _custom_calls(lowered.compiler_ir("stablehlo"))
  ]
  assert targets and all(t in TRITON_TARGETS for t in targets), targets


@pytest.mark.parametrize("name", CASES)
def test_kernel_body_respects_triton_limits(name):
  f, args = CASES[name]
  [kernel] = _kernel_jaxprs(f, args)
  for eqn in _all_eqns(kernel):
    assert eqn.primitive.name not in FORBIDDEN, f"{eqn.primitive.name} in the kernel"
    for var in eqn.outvars:
      shape = getattr(var.aval, "shape", ())
      if isinstance(var.aval, jax.core.ShapedArray):
        assert all(d & (d - 1) == 0 for d in shape), f"non-power-of-two value {shape} from {eqn.primitive.name}"


@pytest.mark.parametrize("name", CASES)
def test_triton_module_verifies(name):
  """The serialized Triton IR parses and verifies (jaxlib-internal API: skipped if moved)."""
  try:
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as triton_lowering

    new_context = triton_lowering._new_ir_context
  except (ImportError, AttributeError) as e:
    pytest.skip(f"jaxlib internals moved: {e}")
  f, args = CASES[name]
  lowered = lower_for_cuda(f, args)
  for op in _custom_calls(lowered.compiler_ir("stablehlo")):
    config = ir.DictAttr(op.attributes["mhlo.backend_config"])
    if "ir" not in config:
      pytest.skip("this jaxlib compiles Triton at lowering time; nothing to parse")
    with new_context():
      module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
      assert module.operation.verify()
