"""`python -m benchmarks.mechanism`: see this package's docstring."""

from benchmarks.mechanism import main

raise SystemExit(main())
