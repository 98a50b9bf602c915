"""Lowerings of shape computation, indexing, casts and data movement."""

from __future__ import annotations


