"""Reading time of hostile logs and tables, at two sizes: linear readers take about twice as long
at twice the size, quadratic ones four times (issue 7: a 20,000-character line took 96 s, a log of
40,000 `import` / unclosed-bracket lines 6 minutes, 40,000 `{` lines 21 s).

    python benchmarks/hostile_input.py [--chars 1000000] [--lines 20000]

Prints, for each shape, the seconds `ingest.logs.parse_log` (or the table reader) takes at a
size (characters of one line, or repetitions of a group of lines) and at twice it, and their ratio.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ingest.logs import parse_log  # noqa: E402
from ingest.table import TableIngester  # noqa: E402

# one long line made of a repeated unit, and many lines of a repeated pair
LINE_UNITS = ["x", "a1", "a.", "1e", "9", "def f(", "A(a=", "Namespace(", "k=v "]
LINE_SHAPES = {"import + unclosed bracket": "import os\nx = (\n", "unclosed brace": "{\n",
               "docstring + import": 'x"""\nimport os\n', "traceback": "Traceback (most recent call last):\n"}
TABLE_SHAPES = {"rows": "1,2\n", "unclosed quotes": '1,"x\n'}


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def table(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.csv"
        path.write_text("a,b\n" + text)
        for _ in TableIngester().read(str(path)):
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, default=1_000_000, help="characters of the one-line cases")
    parser.add_argument("--lines", type=int, default=20_000, help="repetitions of the many-line cases")
    args = parser.parse_args()
    cases = [(f"one line of {unit!r}", args.chars,
              lambda k, u=unit: parse_log("step 1: loss 2.0 " + u * (k // len(u)), "x")) for unit in LINE_UNITS]
    cases += [(f"lines: {name}", args.lines, lambda k, p=pair: parse_log(p * k + "step 1: loss 2.0\n", "x"))
              for name, pair in LINE_SHAPES.items()]
    cases += [(f"table: {name}", args.lines, lambda k, r=row: table(r * k)) for name, row in TABLE_SHAPES.items()]
    print(f"{'shape':36} {'size':>9} {'seconds':>8} {'at 2x':>8} {'ratio':>6}")
    for name, n, run in cases:
        small, large = seconds(lambda: run(n)), seconds(lambda: run(2 * n))
        print(f"{name:36} {n:9,} {small:8.3f} {large:8.3f} {large / max(small, 1e-9):6.1f}", flush=True)


if __name__ == "__main__":
    main()
