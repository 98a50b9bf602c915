"""The model registry: tenants' models, their versions and aliases, and the status of each
version's compile. A domain service: the API and the compile worker go through it; neither
touches those tables directly. Its storage is the shared plumbing's (cloud.db, cloud.storage).

    registry.py  upload, list, resolve for inference (cached briefly), status transitions, aliases
"""

from registry.registry import (
    INTERRUPTED,
    PROGRESS,
    RESOLVE_CACHE_S,
    STATUSES,
    UNMEASURED,
    Registry,
    ServedVersion,
    alias_stack,
    report_and_progress,
    version_ref,
)

__all__ = [
    "INTERRUPTED",
    "PROGRESS",
    "RESOLVE_CACHE_S",
    "STATUSES",
    "UNMEASURED",
    "Registry",
    "ServedVersion",
    "alias_stack",
    "report_and_progress",
    "version_ref",
]
