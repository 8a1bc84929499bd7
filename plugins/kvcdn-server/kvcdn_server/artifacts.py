"""``ArtifactStore``: what the routes and the app hold, one object over the parts of the store.

The parts, one idea each: :mod:`kvcdn_server.rows` (states, object keys, what callers see),
:mod:`kvcdn_server.quota` (reservations), :mod:`kvcdn_server.validation` (names, declared facts
and the bytes at confirm), :mod:`kvcdn_server.uploads` (the state machine, with its leases) and
:mod:`kvcdn_server.collector` (garbage collection). The facade only joins them, so that a route
needs one object and the collector thread one call.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import sqlalchemy as sa

from kvcdn_core import StorageBackend
from kvcdn_server.collector import Collector
from kvcdn_server.uploads import Uploads


class ArtifactStore(Uploads):
    """The upload state machine, with the tenant's quota figures and the collector at hand."""

    def __init__(self, db_engine: sa.Engine, storage: StorageBackend, config, clock: Callable[[], float] = time.time):
        super().__init__(db_engine, storage, config, clock)
        self.collector = Collector(self)

    def collect(self, now: float | None = None) -> dict[str, int]:
        """One pass of the collector (:meth:`kvcdn_server.collector.Collector.collect`)."""
        return self.collector.collect(now)

    def limits(self) -> dict[str, int]:
        return self.quota.limits()

    def usage(self, tenant: str) -> dict[str, int]:
        return self.quota.usage(tenant)

    def reserved(self, tenant: str) -> tuple[int, int]:
        return self.quota.reserved(tenant)
