"""`python -m benchmarks.host_memory`: see this package's docstring."""

from benchmarks.host_memory import main

raise SystemExit(main())
