"""What a server needs that is not transport: the slot engine of continuous batching (:mod:`.slots`) and its
prefix cache (:mod:`.prefix`)."""

from thoughtjax.serving.prefix import PrefixCache, PrefixCacheError
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
  "PrefixCache",
  "PrefixCacheError",
  "SlotDriver",
  "SlotEngine",
  "SlotRequestError",
  "SlotRun",
  "SlotsClosed",
  "SlotsFull",
  "generate_in_slots",
]
