"""The benchmarks, one package per suite, each run as ``python -m benchmarks.<suite>``
from the checkout's root (docs/benchmarks.md lists them and what each measures); results
go to ``benchmarks/results/``, one file per suite and machine."""
