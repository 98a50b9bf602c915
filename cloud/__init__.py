"""Shared server plumbing: settings, errors, object storage, database, the usage ledger, metrics.

One home for what the gateway, the compile workers and the runtime processes share. The scheduler
and the runtime import only its error hierarchy (cloud.errors); the ledger and the metrics are
given to them by whoever builds them (api/services.py). Domain services have packages of their
own: the model registry is registry/, pricing is scheduler/pricing.py.
"""
