"""`python -m benchmarks.uva_read`: see this package's docstring."""

from benchmarks.uva_read import main

raise SystemExit(main())
