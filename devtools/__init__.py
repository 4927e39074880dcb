"""Development tools, not installed with the package (run from the repository root): model
preparation, the server process the tests and benchmarks start, data paths, generated docs."""
