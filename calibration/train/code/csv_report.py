"""Summarise sales data from a CSV export into a monthly report.

The input file is expected to have a header row with at least these columns:

    order_id, order_date, region, product, quantity, unit_price

Dates are ISO formatted (YYYY-MM-DD). Rows that cannot be parsed are counted
and reported at the end instead of aborting the whole run, because exports
from the shop system occasionally contain half-written lines.

Usage:

    python csv_report.py sales.csv --by region --top 5
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Iterable, Iterator


@dataclass(frozen=True)
class Sale:
    """One line of an order, already validated and converted."""

    order_id: str
    order_date: date
    region: str
    product: str
    quantity: int
    unit_price: Decimal

    @property
    def revenue(self) -> Decimal:
        return self.unit_price * self.quantity

    @property
    def month(self) -> str:
        return self.order_date.strftime("%Y-%m")


@dataclass
class ParseStats:
    """Counts of good and bad rows seen while reading the file."""

    ok: int = 0
    bad: int = 0
    reasons: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def reject(self, reason: str) -> None:
        self.bad += 1
        self.reasons[reason] += 1


REQUIRED_COLUMNS = ("order_id", "order_date", "region", "product", "quantity", "unit_price")


def parse_row(row: dict[str, str]) -> Sale:
    """Convert a raw CSV row into a Sale, raising ValueError on bad data."""
    try:
        quantity = int(row["quantity"])
    except (TypeError, ValueError):
        raise ValueError("quantity is not an integer") from None
    if quantity <= 0:
        raise ValueError("quantity must be positive")

    try:
        price = Decimal(row["unit_price"].strip())
    except (AttributeError, InvalidOperation):
        raise ValueError("unit_price is not a number") from None
    if price < 0:
        raise ValueError("unit_price is negative")

    try:
        when = date.fromisoformat(row["order_date"].strip())
    except (AttributeError, ValueError):
        raise ValueError("order_date is not YYYY-MM-DD") from None

    region = (row.get("region") or "").strip() or "unknown"
    return Sale(
        order_id=row["order_id"].strip(),
        order_date=when,
        region=region.title(),
        product=row["product"].strip(),
        quantity=quantity,
        unit_price=price,
    )


def read_sales(path: Path, stats: ParseStats) -> Iterator[Sale]:
    """Yield valid sales from a CSV file, recording rejects in ``stats``."""
    with path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise SystemExit(f"{path}: missing columns: {', '.join(missing)}")
        for row in reader:
            try:
                sale = parse_row(row)
            except ValueError as exc:
                stats.reject(str(exc))
                continue
            stats.ok += 1
            yield sale


def group_revenue(sales: Iterable[Sale], key: str) -> dict[str, dict[str, Decimal]]:
    """Return {month: {group: revenue}} for the chosen grouping column."""
    table: dict[str, dict[str, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
    for sale in sales:
        group = getattr(sale, key)
        table[sale.month][group] += sale.revenue
    return table


def format_money(amount: Decimal) -> str:
    """Format with thousands separators and exactly two decimals."""
    return f"{amount.quantize(Decimal('0.01')):,}"


def render(table: dict[str, dict[str, Decimal]], top: int) -> str:
    lines = []
    for month in sorted(table):
        groups = table[month]
        total = sum(groups.values(), Decimal(0))
        lines.append(f"{month}  total {format_money(total):>14}")
        ranked = sorted(groups.items(), key=lambda item: item[1], reverse=True)
        for name, revenue in ranked[:top]:
            share = (revenue / total * 100) if total else Decimal(0)
            lines.append(f"    {name:<20} {format_money(revenue):>14}  {share:5.1f}%")
        if len(ranked) > top:
            rest = sum((r for _, r in ranked[top:]), Decimal(0))
            lines.append(f"    {'(other)':<20} {format_money(rest):>14}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv_file", type=Path)
    parser.add_argument("--by", choices=["region", "product"], default="region")
    parser.add_argument("--top", type=int, default=5, help="groups to show per month")
    args = parser.parse_args(argv)

    stats = ParseStats()
    table = group_revenue(read_sales(args.csv_file, stats), args.by)
    print(render(table, args.top))

    print(f"rows read: {stats.ok}, rejected: {stats.bad}", file=sys.stderr)
    for reason, count in sorted(stats.reasons.items(), key=lambda kv: -kv[1]):
        print(f"  {count:6d}  {reason}", file=sys.stderr)
    return 0 if stats.ok else 1


if __name__ == "__main__":
    sys.exit(main())
