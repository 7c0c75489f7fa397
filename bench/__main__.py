"""``python -m bench``: every benchmark, tables printed, bench/results.{md,png} written."""

from bench.run_all import main

main()
