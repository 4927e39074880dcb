"""One-off diagnostics behind docs/PROFILE.md and the design choices (not user benchmarks)."""
