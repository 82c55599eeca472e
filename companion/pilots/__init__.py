"""The pilots: run once, by hand, before a zoo's primary value is measured; not DVC stages.

A pilot fixes what the pre-registration leaves to data that say nothing about the result — a radius by
test–retest, a test-set size by the gap's reliability, a protocol or a member count by power, a training recipe
by a fit criterion — on members outside the zoo it serves, and writes ``reports/pilots/<name>.{json,md}``.
Every statistic a pilot uses is :mod:`companion.analysis`'s, the stages' own.

* :mod:`companion.pilots.vision` — the vision zoo's radii, test-set size and image count (``vision_pilot``,
  ``vision16_pilot`` sections of ``params.yaml``).
* :mod:`companion.pilots.vision_minima` — the vision recipe under which every member fits (``vision_minima_pilot``).
* :mod:`companion.pilots.language` — the language protocol: radii, pairs × iterations, gap reliability, power.
* :mod:`companion.pilots.minilm` — the MiniLM row: radii under the correction-ratio rule, protocol and member
  count by the power of the paired Δτ within the CPU budget.
* :mod:`companion.pilots.minilm_power` — a design note: the MiniLM design of highest power within the budget, from
  published numbers only.
* :mod:`companion.pilots.common` — the report files they share.

Each runs as ``python -m companion.pilots.<name>`` (``--help`` for its options). A pilot's committed report records
the command it ran at its commit; before these modules moved here (with their statistics now
:mod:`companion.analysis`'s) that command named ``companion.experiments.<name>_pilot``.
"""
