"""`python -m benchmarks.gpu`: see this package's docstring."""

from benchmarks.gpu import main

raise SystemExit(main())
