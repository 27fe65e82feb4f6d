"""Which phases of one side's eval failed. A failed phase makes the report incomplete: `quantkit eval` exits
non-zero naming it, the gates refuse the report, and the baseline cache never stores such a side. Each probe
says what of it counts as failed (`Probe.failures`, quantkit/evaluate/probes); a speed-only side (a serving
variant) is judged on the serving probes alone.
"""

from __future__ import annotations


def failed_phases(side: dict | None, role: str, suite: dict, speed_only: bool = False) -> list[str]:
    """["<role> <phase>: <why>", ...] for every phase of the side that the suite asked for and that failed."""
    from quantkit.evaluate.probes import PROBES, SERVING

    if side is None:
        return []
    return [f"{role} {phase}: {why}" for probe in (SERVING if speed_only else PROBES)
            for phase, why in probe.failures(side, suite)]
