"""One CLI per question (``python -m benchmarks.<name>``); docs/RESULTS.md indexes them and
``python -m benchmarks.report`` writes it from the canonical results in ``benchmarks/results/``."""
