"""`python -m benchmarks.routing`: see this package's docstring."""

from benchmarks.routing import main

raise SystemExit(main())
