"""`python -m benchmarks.host_compute`: see this package's docstring."""

from benchmarks.host_compute import main

raise SystemExit(main())
