"""Shared server plumbing: settings, errors, object storage, database, the usage record and
ledger, metrics.

One home for what the gateway, the compile workers and the runtime processes share. It imports
nothing of ours above it (no compiler, scheduler, runtime, worker or API): importing the settings
must stay cheap, a container's health check does it. The scheduler and the runtime import only
its error hierarchy (cloud.errors) and the usage record (cloud.usage); the ledger and the metrics
are given to them by whoever builds them (api/services.py). Domain services have packages of their
own: the model registry is registry/, pricing is scheduler/pricing.py, request validation against
a model's signature is api/validation.py.
"""
