"""Generate the numeric part of the quantkit calibration corpus.

Writes tables, CSV files and log lines with realistic, varied values into
calibration/train/numbers/. Everything is driven by one seeded random number
generator, so running the script again reproduces the committed files byte for
byte (same Python version assumed):

    python calibration/tools/make_numbers.py

Only the Python standard library is used. The hand-written file
``worked_examples.txt`` in the same folder is NOT produced by this script.
"""

from __future__ import annotations

import math
import random
from datetime import date, datetime, timedelta
from pathlib import Path

SEED = 20261107
OUT = Path(__file__).resolve().parent.parent / "train" / "numbers"


def weather_daily(rng: random.Random) -> str:
    """One year of daily observations from a fictional coastal station."""
    lines = ["date,t_max_c,t_min_c,rain_mm,sunshine_h,wind_mean_kph,gust_kph,pressure_hpa"]
    day = date(2025, 1, 1)
    pressure = 1013.0
    wet_spell = 0
    while day.year == 2025:
        doy = day.timetuple().tm_yday
        season = math.cos(2 * math.pi * (doy - 200) / 365)  # +1 mid-July, -1 mid-January
        t_mean = 10.5 + 6.5 * season + rng.gauss(0, 2.0)
        spread = 6.0 + 2.0 * season + rng.uniform(-2, 2)
        t_max = t_mean + spread / 2
        t_min = t_mean - spread / 2
        pressure += rng.gauss(0, 5) - (pressure - 1013) * 0.25
        low = pressure < 1008
        if wet_spell > 0 or low or rng.random() < 0.3:
            wet_spell = max(0, wet_spell - 1) if wet_spell else rng.choice([0, 0, 1, 2, 3])
            rain = round(rng.expovariate(1 / (4.5 if low else 2.0)), 1)
        else:
            rain = 0.0
        day_length = 12 + 4.3 * math.cos(2 * math.pi * (doy - 172) / 365)
        cloud = min(1.0, max(0.0, 0.55 - 0.3 * season + (0.3 if rain > 0 else -0.1) + rng.gauss(0, 0.15)))
        sunshine = round(max(0.0, day_length * (1 - cloud) * 0.85), 1)
        wind = max(3.0, rng.gauss(18 + (12 if low else 0) - 4 * season, 6))
        gust = wind * rng.uniform(1.4, 2.1)
        lines.append(
            f"{day.isoformat()},{t_max:.1f},{t_min:.1f},{rain:.1f},{sunshine:.1f},"
            f"{wind:.0f},{gust:.0f},{pressure:.1f}"
        )
        day += timedelta(days=1)
    return "\n".join(lines) + "\n"


def timetable(rng: random.Random) -> str:
    """A weekday regional rail timetable with a few express services."""
    stops = [
        ("Northport", 0), ("Harbour Road", 4), ("Kingsmead", 9), ("Ashby Junction", 15),
        ("Fenwick", 21), ("Lower Marston", 26), ("Castleford Parkway", 33),
        ("St Anne's", 38), ("Millbridge", 44), ("Southgate Central", 52),
    ]
    express_skip = {"Harbour Road", "Lower Marston", "St Anne's"}
    first = datetime(2025, 3, 3, 5, 48)
    services = []
    t = first
    for i in range(16):
        express = i % 4 == 2
        services.append((t, express))
        t += timedelta(minutes=rng.choice([25, 30, 30, 30, 35, 40]) if 6 <= t.hour < 19 else 60)
    header = f"{'Station':<20}" + "".join(f"{('X' if e else '') + str(n + 1):>7}" for n, (_, e) in enumerate(services))
    out = [
        "NORTHPORT - SOUTHGATE CENTRAL  Monday to Friday  valid from 3 March 2025",
        "X = express service, calls at principal stations only.  | = does not call",
        "",
        header,
        "-" * len(header),
    ]
    for name, offset in stops:
        row = f"{name:<20}"
        for start, express in services:
            if express and name in express_skip:
                row += f"{'|':>7}"
                continue
            mins = offset if not express else int(offset * 0.82)
            mins += rng.choice([0, 0, 0, 1]) if offset else 0
            row += f"{(start + timedelta(minutes=mins)).strftime('%H:%M'):>7}"
        out.append(row)
    out += ["", "Journey time Northport to Southgate Central: stopping trains about 53 minutes, express about 43 minutes.",
            "Services continue at the same pattern until 23:10. Fares and Saturday times are published separately.", ""]
    return "\n".join(out)


def financial_statements(rng: random.Random) -> str:
    """Eight quarters of a small fictional company's income statement."""
    out = [
        "HARBOURLIGHT SOFTWARE LTD - CONDENSED QUARTERLY INCOME STATEMENT (unaudited)",
        "All figures in thousands of GBP",
        "",
    ]
    quarters = [f"Q{q} {y}" for y in (2023, 2024) for q in (1, 2, 3, 4)]
    revenue = 1840.0
    rows: dict[str, list[float]] = {k: [] for k in (
        "Subscription revenue", "Services revenue", "Total revenue", "Cost of revenue",
        "Gross profit", "Research and development", "Sales and marketing",
        "General and administrative", "Operating profit", "Net finance cost",
        "Profit before tax", "Tax", "Profit for the period")}
    for _ in quarters:
        revenue *= 1 + rng.uniform(0.02, 0.07)
        subs = revenue * rng.uniform(0.78, 0.84)
        services = revenue - subs
        cost = subs * rng.uniform(0.18, 0.22) + services * rng.uniform(0.62, 0.75)
        gross = revenue - cost
        rnd = revenue * rng.uniform(0.24, 0.29)
        sales = revenue * rng.uniform(0.21, 0.27)
        admin = revenue * rng.uniform(0.09, 0.12)
        op = gross - rnd - sales - admin
        fin = rng.uniform(8, 22)
        pbt = op - fin
        tax = max(0.0, pbt * 0.25)
        for key, val in zip(rows, (subs, services, revenue, -cost, gross, -rnd, -sales, -admin,
                                   op, -fin, pbt, -tax, pbt - tax)):
            rows[key].append(val)
    width = 28
    out.append(f"{'':<{width}}" + "".join(f"{q:>10}" for q in quarters))
    for key, vals in rows.items():
        if key in ("Total revenue", "Gross profit", "Operating profit", "Profit before tax", "Profit for the period"):
            out.append(f"{'':<{width}}" + "".join(f"{'-------':>10}" for _ in vals))
        cells = "".join(f"{(f'({-v:,.1f})' if v < 0 else f'{v:,.1f}'):>10}" for v in vals)
        out.append(f"{key:<{width}}{cells}")
    out.append("")
    total = rows["Total revenue"]
    out.append(f"Revenue growth 2024 vs 2023: {(sum(total[4:]) / sum(total[:4]) - 1) * 100:.1f}%")
    margins = [g / r * 100 for g, r in zip(rows["Gross profit"], total)]
    out.append("Gross margin by quarter (%): " + ", ".join(f"{m:.1f}" for m in margins))
    out.append("")
    return "\n".join(out)


def server_log(rng: random.Random) -> str:
    """Plain-text web server access log lines over a working morning."""
    paths = [
        ("GET", "/", 0.25), ("GET", "/pricing", 0.08), ("GET", "/docs/getting-started", 0.1),
        ("GET", "/api/v1/notes", 0.2), ("POST", "/api/v1/notes", 0.07),
        ("GET", "/api/v1/search?q=", 0.12), ("PATCH", "/api/v1/notes/", 0.05),
        ("GET", "/static/app.js", 0.08), ("POST", "/login", 0.05),
    ]
    words = ["tide", "budget", "sourdough", "rust", "backup", "invoice", "garden", "train", "tea"]
    ips = [f"203.0.113.{rng.randint(2, 254)}" for _ in range(14)] + [f"198.51.100.{rng.randint(2, 254)}" for _ in range(6)]
    t = datetime(2025, 2, 17, 8, 0, 0)
    lines = []
    for _ in range(170):
        t += timedelta(seconds=rng.expovariate(1 / 40))
        method, path, _w = rng.choices(paths, weights=[p[2] for p in paths])[0]
        if path.endswith("q="):
            path += rng.choice(words)
        elif path.endswith("/notes/"):
            path += f"{rng.randrange(16**8):08x}"
        r = rng.random()
        status = 200 if method == "GET" else 201 if method == "POST" and path != "/login" else 200
        if r < 0.03:
            status = 500
        elif r < 0.07 and path not in ("/", "/pricing"):
            status = 404
        elif r < 0.10 and method != "GET":
            status = 422
        elif path == "/login" and r < 0.3:
            status = 401
        latency = rng.lognormvariate(math.log(35 if "/api/" in path else 8), 0.6)
        if status == 500:
            latency += rng.uniform(800, 5000)
        size = 0 if status == 204 else int(rng.lognormvariate(math.log(2400), 0.9))
        lines.append(
            f"{t.strftime('%Y-%m-%dT%H:%M:%S')}.{rng.randrange(1000):03d}Z {rng.choice(ips)} "
            f"\"{method} {path} HTTP/1.1\" {status} {size} {latency:.1f}ms"
        )
    return "\n".join(lines) + "\n"


def league_table(rng: random.Random) -> str:
    """A consistent end-of-season football league table (38 matches each)."""
    teams = [
        "Riverside United", "Castle Rovers", "Northport Athletic", "Ashby Town", "Millbridge City",
        "Fenwick Wanderers", "Southgate FC", "Kingsmead Albion", "Harbour Road", "St Anne's Rangers",
        "Lower Marston", "Castleford Park", "Westholme Villa", "Eastfield Borough", "Greyfriars",
        "Oakley Celtic", "Brackenhurst", "Dunmore Town", "Pelham Athletic", "Yewbridge",
    ]
    strength = {t: rng.gauss(0, 0.45) for t in teams}
    rec = {t: [0, 0, 0, 0, 0] for t in teams}  # W D L GF GA
    for home in teams:
        for away in teams:
            if home == away:
                continue
            diff = strength[home] - strength[away]
            hg = min(7, int(rng.expovariate(1 / max(0.3, 1.45 + 0.5 * diff))))
            ag = min(7, int(rng.expovariate(1 / max(0.3, 1.15 - 0.5 * diff))))
            rec[home][3] += hg; rec[home][4] += ag
            rec[away][3] += ag; rec[away][4] += hg
            if hg > ag:
                rec[home][0] += 1; rec[away][2] += 1
            elif hg < ag:
                rec[away][0] += 1; rec[home][2] += 1
            else:
                rec[home][1] += 1; rec[away][1] += 1
    table = sorted(teams, key=lambda t: (-(3 * rec[t][0] + rec[t][1]), -(rec[t][3] - rec[t][4]), -rec[t][3], t))
    out = ["COUNTY LEAGUE PREMIER DIVISION - FINAL TABLE 2024/25", "",
           f"{'Pos':>3}  {'Team':<20}{'P':>4}{'W':>4}{'D':>4}{'L':>4}{'GF':>5}{'GA':>5}{'GD':>5}{'Pts':>5}"]
    for pos, t in enumerate(table, 1):
        w, d, l, gf, ga = rec[t]
        out.append(f"{pos:>3}  {t:<20}{w + d + l:>4}{w:>4}{d:>4}{l:>4}{gf:>5}{ga:>5}{gf - ga:>+5}{3 * w + d:>5}")
        if pos in (2, 17):
            out.append("     " + "-" * 55)
    out += ["", "Top two promoted; bottom three relegated.", ""]
    return "\n".join(out)


def household_budget(rng: random.Random) -> str:
    """Monthly household spending by category, with a totals row."""
    cats = {"rent": 950, "energy": 0, "water": 38, "council_tax": 142, "groceries": 310,
            "transport": 96, "phone_internet": 48, "eating_out": 85, "clothing": 40,
            "leisure": 60, "gifts": 25, "savings": 250}
    months = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
    lines = ["month," + ",".join(cats) + ",total"]
    totals = {c: 0.0 for c in cats}
    for i, m in enumerate(months):
        row = []
        for c, base in cats.items():
            if c == "energy":
                v = 55 + 70 * (1 + math.cos(2 * math.pi * i / 12)) / 2 + rng.uniform(-8, 8)
            elif c == "gifts":
                v = base + (180 if m == "Dec" else 0) + rng.uniform(-20, 40)
            elif c in ("rent", "council_tax", "water", "phone_internet", "savings"):
                v = base + (10 if c == "phone_internet" and i >= 4 else 0)
            else:
                v = max(0.0, base * rng.uniform(0.6, 1.45))
            v = round(v, 2)
            totals[c] += v
            row.append(v)
        lines.append(m + "," + ",".join(f"{v:.2f}" for v in row) + f",{sum(row):.2f}")
    lines.append("TOTAL," + ",".join(f"{totals[c]:.2f}" for c in cats) + f",{sum(totals.values()):.2f}")
    return "\n".join(lines) + "\n"


def lab_measurements(rng: random.Random) -> str:
    """Pendulum periods and a cooling curve, as a student's lab record."""
    out = ["# Experiment 1: period of a simple pendulum, 5 timings of 10 swings each",
           "length_m,t10_run1_s,t10_run2_s,t10_run3_s,t10_run4_s,t10_run5_s,mean_period_s,g_estimate_m_s2"]
    for length in (0.20, 0.30, 0.40, 0.50, 0.60, 0.70, 0.80, 0.90, 1.00, 1.20):
        true_t = 2 * math.pi * math.sqrt(length / 9.81)
        runs = [10 * true_t + rng.gauss(0, 0.12) for _ in range(5)]
        period = sum(runs) / 50
        g = 4 * math.pi ** 2 * length / period ** 2
        out.append(f"{length:.2f}," + ",".join(f"{r:.2f}" for r in runs) + f",{period:.3f},{g:.2f}")
    out += ["", "# Experiment 2: cooling of 200 ml of water in a ceramic mug, room 21.0 C",
            "time_min,temp_c"]
    for minute in range(0, 61, 3):
        temp = 21.0 + (88.5 - 21.0) * math.exp(-minute / 31.0) + rng.gauss(0, 0.25)
        out.append(f"{minute},{temp:.1f}")
    return "\n".join(out) + "\n"


def exchange_rates(rng: random.Random) -> str:
    """Daily reference exchange rates against the euro for two months."""
    rates = {"USD": 1.0830, "GBP": 0.8470, "JPY": 161.20, "CHF": 0.9440, "SEK": 11.412,
             "NOK": 11.695, "PLN": 4.2810, "CZK": 25.240}
    decimals = {"JPY": 2, "CZK": 3, "SEK": 3, "NOK": 3}
    lines = ["date," + ",".join(rates)]
    day = date(2025, 5, 1)
    while day < date(2025, 7, 1):
        if day.weekday() < 5:
            for k in rates:
                rates[k] *= math.exp(rng.gauss(0, 0.0035))
            lines.append(day.isoformat() + "," + ",".join(
                f"{v:.{decimals.get(k, 4)}f}" for k, v in rates.items()))
        day += timedelta(days=1)
    return "\n".join(lines) + "\n"


def main() -> None:
    rng = random.Random(SEED)
    OUT.mkdir(parents=True, exist_ok=True)
    outputs = {
        "weather_station_2025.csv": weather_daily,
        "rail_timetable.txt": timetable,
        "quarterly_income_statement.txt": financial_statements,
        "web_access.log": server_log,
        "league_table.txt": league_table,
        "household_budget_2025.csv": household_budget,
        "lab_measurements.csv": lab_measurements,
        "eur_reference_rates.csv": exchange_rates,
    }
    for name, make in outputs.items():
        text = make(rng)
        (OUT / name).write_text(text, encoding="utf-8")
        print(f"{name:32} {len(text.encode('utf-8')):>7} bytes")


if __name__ == "__main__":
    main()
