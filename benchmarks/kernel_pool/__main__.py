"""`python -m benchmarks.kernel_pool`: see this package's docstring."""

from benchmarks.kernel_pool import main

raise SystemExit(main())
