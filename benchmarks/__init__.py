"""Performance benchmarks for hideseek (issue 6).  Not part of the installed package.

``python -m benchmarks.bench_sharpness --help``; results in ``reports/benchmarks.md``.
"""


def machine_state(machine: dict) -> str:
    """"quiet" when the 1-minute load average at the start was below 1 (nothing else ran), else
    "busy (shared)"; ``machine``: a result file's ``machine`` block (with ``load_avg_start``)."""
    return "quiet" if machine.get("load_avg_start", [99])[0] < 1.0 else "busy (shared)"
