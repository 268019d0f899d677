"""`python -m benchmarks.e2e`: see this package's docstring."""

from benchmarks.e2e import main

raise SystemExit(main())
