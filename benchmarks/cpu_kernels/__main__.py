"""`python -m benchmarks.cpu_kernels`: see this package's docstring."""

from benchmarks.cpu_kernels import main

raise SystemExit(main())
