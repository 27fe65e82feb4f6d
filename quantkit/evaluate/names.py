"""Compatibility: the metric names moved into the catalogue (quantkit/evaluate/catalogue.py). quantkit/recipe.py
imports `is_metric_name` from here; new code imports the catalogue."""

from quantkit.evaluate.catalogue import METRIC_PATTERNS, dig, is_metric_name

__all__ = ["METRIC_PATTERNS", "dig", "is_metric_name"]
