"""What a server needs that is not transport: the slot engine of continuous batching (:mod:`.slots`), a request in
it (:mod:`.slot_run`), its compiled programs (:mod:`.slot_program`) and the thread that drives it (:mod:`.driver`), its prefix cache (:mod:`.prefix`),
the pool of engines every request shares (:mod:`.pool`) and idle release (:mod:`.idle`)."""

from thoughtjax.serving.driver import SlotDriver, generate_in_slots
from thoughtjax.serving.errors import SlotRequestError, SlotsClosed, SlotsFull
from thoughtjax.serving.pool import EnginePool, PoolFull
from thoughtjax.serving.prefix import PrefixCache, PrefixCacheError
from thoughtjax.serving.slot_run import Prefilled, SlotRun
from thoughtjax.serving.slots import SlotEngine

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
