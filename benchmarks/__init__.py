"""Performance benchmarks for hideseek (issue 6).  Not part of the installed package.

``python -m benchmarks.bench_sharpness --help``; results in ``reports/benchmarks.md``.
"""
