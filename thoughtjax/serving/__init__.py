"""What a server needs that is not transport: the slot engine of continuous batching (:mod:`.slots`)."""

from thoughtjax.serving.slots import (
  Prefilled,
  SlotDriver,
  SlotEngine,
  SlotRequestError,
  SlotRun,
  SlotsClosed,
  SlotsFull,
  generate_in_slots,
)

__all__ = [
  "Prefilled",
  "SlotDriver",
  "SlotEngine",
  "SlotRequestError",
  "SlotRun",
  "SlotsClosed",
  "SlotsFull",
  "generate_in_slots",
]
