"""Module-name matching: a recipe's `targets` / `ignore` entries against module names, and its inverse, the
anchored patterns an export's config groups name exact modules with."""

from __future__ import annotations

import re


def matches_pattern(patterns: list[str], name: str, cls_name: str) -> bool:
    """A module matches a `targets`/`ignore` entry by full name, by class name, or by `re:<regex>` on its name."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p == name or p == cls_name:
            return True
    return False


def exact_targets(names: list[str]) -> list[str]:
    """`model.layers.{0,1}.mlp.down_proj` -> `re:^model\\.layers\\.(?:0|1)\\.mlp\\.down_proj$`."""
    pattern = re.compile(r"^(.*)\.(\d+)\.(.+)$")
    grouped: dict[tuple[str, str], list[int]] = {}
    for n in names:
        m = pattern.match(n)
        grouped.setdefault((m.group(1), m.group(3)), []).append(int(m.group(2)))
    return [f"re:^{re.escape(base)}\\.(?:{'|'.join(str(i) for i in sorted(idx))})\\.{re.escape(suffix)}$"
            for (base, suffix), idx in sorted(grouped.items())]
