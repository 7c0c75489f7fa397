"""Runs every benchmark in bench/ in one process and prints their tables.

Run:  python bench/run_all.py
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench import eager_overhead  # noqa: E402


def main() -> None:
    eager_overhead.main()


if __name__ == "__main__":
    main()
