"""One-off diagnostics behind docs/research/ and the design choices (not user benchmarks)."""
