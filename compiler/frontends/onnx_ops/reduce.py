"""Lowerings of reductions, normalizations, softmax variants and losses."""

from __future__ import annotations


