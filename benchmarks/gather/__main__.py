"""`python -m benchmarks.gather`: see this package's docstring."""

from benchmarks.gather import main

raise SystemExit(main())
