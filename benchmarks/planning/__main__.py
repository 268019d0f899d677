"""`python -m benchmarks.planning`: see this package's docstring."""

from benchmarks.planning import main

raise SystemExit(main())
