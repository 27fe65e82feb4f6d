"""Temporary: quantkit/tune/study.py imports `Strict` from here; it lives in quantkit/strict.py. Delete this file
once that import is updated (stage bases: quantkit/algorithms/base.py)."""

from quantkit.strict import Strict  # noqa: F401
