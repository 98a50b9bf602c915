"""Lowerings of element-wise math, comparison and logic ops."""

from __future__ import annotations


