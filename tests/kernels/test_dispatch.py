"""The kernel dispatch rule: an explicit choice wins, the default is XLA until a GPU run earns Pallas."""

import pytest

from thoughtjax.errors import UserError
from thoughtjax.kernels import dispatch
from thoughtjax.kernels.sample_stop import resolve_dispatch


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("choice", ["xla", "pallas"])
def test_an_explicit_choice_wins_on_every_backend(choice, backend):
  assert dispatch.resolve(choice, backend) == choice


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_the_default_is_xla_on_every_backend_while_pallas_is_not_earned(backend):
  assert dispatch.PALLAS_DEFAULT_ON_GPU is False
  assert dispatch.resolve(None, backend) == "xla"


def test_flipping_the_constant_makes_pallas_the_gpu_default_only(monkeypatch):
  monkeypatch.setattr(dispatch, "PALLAS_DEFAULT_ON_GPU", True)
  assert dispatch.resolve(None, "gpu") == "pallas"
  assert dispatch.resolve(None, "cpu") == "xla"


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
