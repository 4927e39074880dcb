"""``python -m benchmarks.soak``: see the package's docstring."""

from benchmarks.soak.run import main

raise SystemExit(main())
