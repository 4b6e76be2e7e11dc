"""Speed measurements, run by hand: `python -m benchmarks.<name> [--quick]` or `make bench`."""
