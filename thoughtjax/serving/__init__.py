"""What a server needs that is not transport: the slot engine of continuous batching (:mod:`.slots`), its prefix
cache (:mod:`.prefix`), the pool of engines every request shares (:mod:`.pool`) and idle release (:mod:`.idle`)."""

from thoughtjax.serving.pool import EnginePool, PoolFull
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
  "EnginePool",
  "PoolFull",
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
