"""Sharing the chain key's common chains between processor replicas through Redis.

Each replica learns common chains from the traffic it sees (extproc.core.chains.ChainSketch).
Every ``interval_s`` it publishes what it promoted since the last round (one ``HSET`` field per
promotion, on ``<key_prefix>:chains``, keyed by the promotion's first chain so a promotion
learnt twice is stored once) and merges every promotion stored there (``HGETALL``). Promotions
only add common chains and grandfathered conversations, so merging is order-free and
idempotent, and two replicas agree once both have run a round after the promotion: the warm-up
during which they may key a conversation differently is bounded by the interval plus the time
each needs to see ``common_after`` conversations (measured in
tests/stream/test_chain_sync.py). The hash is bounded like the sketch (``max_common`` fields;
when full, new promotions are kept locally only). Redis errors are logged and counted as a skipped
round: keys then come from the local sketch alone, never an error for the request.
"""

from __future__ import annotations

import asyncio
import logging

from extproc.core.chains import ChainSketch, decode_promotion, encode_promotion
from extproc.ledger.redis_client import UNAVAILABLE, AnyRedis

log = logging.getLogger("extproc.chains")

# Before serving (ChainSync.warm): rounds tried, and the pause after a failed one.
WARM_ATTEMPTS = 5
WARM_SPACING_S = 0.2


class ChainSync:
    def __init__(self, redis: AnyRedis, key_prefix: str, sketch: ChainSketch) -> None:
        self._redis = redis
        self._key = f"{key_prefix}:chains"
        self._sketch = sketch
        self.rounds = 0
        self.failures = 0

    async def round(self) -> bool:
        """Publish local promotions, merge everyone's. One pipelined round trip; False when
        Redis did not answer."""
        fresh = self._sketch.drain_promotions()
        try:
            stored = int(await self._redis.hlen(self._key)) if fresh else 0
            pipe = self._redis.pipeline(transaction=False)
            room = self._sketch.params.max_common - stored
            for promotion in fresh[: max(0, room)]:
                pipe.hset(self._key, f"{promotion.chains[0]:016x}", encode_promotion(promotion))
            pipe.hgetall(self._key)
            results = await pipe.execute()
        except UNAVAILABLE as exc:
            self.failures += 1
            # Not lost: promotions stay in the local sketch, and are offered again next round.
            self._sketch.requeue(fresh)
            log.warning("chain sync round failed", extra={"error": str(exc)})
            return False
        everything = results[-1]
        promotions = [decode_promotion(value) for value in everything.values()]
        self._sketch.merge(p for p in promotions if p is not None)
        self.rounds += 1
        return True

    async def warm(self, attempts: int = WARM_ATTEMPTS, spacing_s: float = WARM_SPACING_S) -> bool:
        """A first round before serving, retried a few times: True once one answered."""
        for attempt in range(attempts):
            if await self.round():
                return True
            if attempt + 1 < attempts:
                await asyncio.sleep(spacing_s)
        return False

    async def run(self, interval_s: float, warmed: bool = False) -> None:
        """A round every ``interval_s``; ``warmed``: the first one already ran (warm)."""
        if warmed:
            await asyncio.sleep(interval_s)
        while True:
            await self.round()
            await asyncio.sleep(interval_s)

    async def aclose(self) -> None:
        await self._redis.aclose()
