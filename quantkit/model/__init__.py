"""Models: architecture specs (arch.py), where weights come from (sources.py) and lazy layer-at-a-time
loading (checkpoint.py)."""


class ModelError(RuntimeError):
    """A model problem, phrased for the user: what was tried and what to do."""
