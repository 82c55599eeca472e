"""One module per figure or table of the paper; each returns data, no plotting.

The notebooks in ``notebooks/`` call into these modules and do the plotting;
``companion.pipeline`` runs the notebooks as DVC stages.

* :mod:`~companion.experiments.correlation` -- Kendall tau-b with bootstrap
  intervals, split-half choice of the radius (shared by every zoo).
* :mod:`~companion.experiments.toy` -- the scalar toy model (Figures 1, 6).
* :mod:`~companion.experiments.diagonal` -- diagonal networks (Figure 3,
  Table 1 row 1).
* :mod:`~companion.experiments.table1` -- assembles Table 1 from the stages'
  metrics files.
"""
