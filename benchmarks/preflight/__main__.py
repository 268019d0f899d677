"""`python -m benchmarks.preflight`: see this package's docstring."""

from benchmarks.preflight import main

raise SystemExit(main())
