"""The kernel dispatch rule: an explicit choice wins; the default is Pallas on a GPU, XLA elsewhere."""

import pytest

from thoughtjax.errors import UserError
from thoughtjax.kernels import dispatch
from thoughtjax.kernels.sample_stop import resolve_dispatch


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("choice", ["xla", "pallas"])
def test_an_explicit_choice_wins_on_every_backend(choice, backend):
  assert dispatch.resolve(choice, backend) == choice


@pytest.mark.parametrize("backend,default", [("cpu", "xla"), ("gpu", "pallas"), ("tpu", "xla")])
def test_the_default_is_pallas_on_a_gpu_only(backend, default):
  assert dispatch.resolve(None, backend) == default


def test_clearing_the_constant_makes_xla_the_default_everywhere(monkeypatch):
  monkeypatch.setattr(dispatch, "PALLAS_DEFAULT_ON_GPU", False)
  assert {dispatch.resolve(None, backend) for backend in ("cpu", "gpu", "tpu")} == {"xla"}


@pytest.mark.parametrize("bad", ["cuda", "XLA", "", "triton"])
def test_an_unknown_choice_is_a_user_error_naming_value_and_choices(bad):
  with pytest.raises(UserError) as info:
    dispatch.resolve(bad, "cpu")
  message = str(info.value)
  assert isinstance(info.value, dispatch.KernelChoiceError)
  assert repr(bad) in message and "'xla'" in message and "'pallas'" in message


def test_the_kernels_use_the_same_rule():
  assert resolve_dispatch(None, None) == (dispatch.default(), dispatch.interpret_default())
  assert resolve_dispatch("pallas", True) == ("pallas", True)
  with pytest.raises(dispatch.KernelChoiceError):
    resolve_dispatch("cuda", None)
