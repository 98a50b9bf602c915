"""Shared server plumbing: settings, errors, object storage, database, metering, metrics.

Everything the api, worker, scheduler and runtime share lives here once.
"""
