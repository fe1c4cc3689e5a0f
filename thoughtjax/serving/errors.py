"""Errors of the slot engines: a request refused as given is a named ``UserError``."""

from __future__ import annotations

from thoughtjax.constraint import ConstraintError, Matcher
from thoughtjax.errors import UserError


class SlotsFull(UserError, RuntimeError):
  """Every slot of the engine holds a request; wait for one to be freed (or use a SlotDriver's queue)."""


class SlotsClosed(RuntimeError):
  """The engine's driver was closed (the server stopped) while the request held a slot."""


class SlotRequestError(UserError, ValueError):
  """A request a slot engine cannot hold as given; the message names the limit and the fix."""


class ConstraintsRefused(ConstraintError):
  """Requests of one prefill whose constraint could not give its first mask (past llguidance's limits), raised
  before the prefill ran: ``refused``, (matcher, :class:`~thoughtjax.constraint.ConstraintError`) pairs. A driver
  ends those requests with their errors and prefills the others."""

  def __init__(self, refused: list[tuple[Matcher, ConstraintError]]):
    super().__init__(str(refused[0][1]))
    self.refused = refused
