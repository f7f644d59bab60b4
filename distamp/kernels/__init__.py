"""Fused unscale kernels: unscale + non-finite check (+ sum of squares) in one read pass."""

from __future__ import annotations

from distamp.kernels.reference import unscale_and_check_

__all__ = ["unscale_and_check_"]
