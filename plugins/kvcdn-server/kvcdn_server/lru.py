"""A small thread-safe LRU with a budget in bytes: the in-process engine keeps its models and
loaded caches in two, the remote engine its tokenizers and artifacts' token ids."""

from __future__ import annotations

import collections
import threading
from typing import Any


class Lru:
    """A small thread-safe LRU with a budget in bytes (and optionally a number of items)."""

    def __init__(self, budget: int, max_items: int | None = None):
        self.budget, self.max_items = budget, max_items
        self.items: collections.OrderedDict[Any, tuple[Any, int]] = collections.OrderedDict()
        self.lock = threading.Lock()

    def get(self, key):
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key][0]
        return None

    def put(self, key, value, cost: int) -> None:
        """Keep ``value``, evicting the least recently used until the rest fits beside it.

        The newest item stays even when it alone is over the budget (a model the operator allowed
        must be usable); callers refuse what must not be held at all (see ``artifact_too_large``).
        """
        with self.lock:
            self.items[key] = (value, cost)
            self.items.move_to_end(key)
            while len(self.items) > 1 and (
                sum(c for _, c in self.items.values()) > self.budget
                or (self.max_items is not None and len(self.items) > self.max_items)
            ):
                self.items.popitem(last=False)

    def resident_bytes(self) -> int:
        with self.lock:
            return sum(c for _, c in self.items.values())
