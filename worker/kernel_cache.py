"""The schedule search's kernel cache (compiler.search.schedule.KernelCache) in the object store:
a kernel's measured winner on a device, under `kernels/<key>.json`, shared by every compile
worker and every model (a kernel's key says nothing about the model or tenant it came from:
its canonical term, the device's fingerprint, the measuring sizes, the compiler's version)."""

from __future__ import annotations

import json
import logging
from typing import Any

from cloud.errors import NotFound
from cloud.storage import ObjectStore

log = logging.getLogger(__name__)

PREFIX = "kernels/"


class ObjectStoreKernelCache:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def get(self, key: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.store.get(f"{PREFIX}{key}.json"))
        except NotFound:
            return None
        except Exception as exc:  # noqa: BLE001 - a torn record or a store error: measured again
            log.warning("kernel cache record %s unreadable (%s): measured again", key, exc)
            return None

    def put(self, key: str, record: dict[str, Any]) -> None:
        try:
            self.store.put(f"{PREFIX}{key}.json", json.dumps(record).encode())
        except Exception as exc:  # noqa: BLE001 - the compile stands without its cache entry
            log.warning("kernel cache record %s not stored: %s", key, exc)
