"""The benchmarks, an importable package above the tooling: `python -m bench.NAME` or
`python bench/NAME.py` (each is also a script)."""
