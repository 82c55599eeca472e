"""Maximisers over a ball of perturbations."""
from .apgd import (SolverResult, SolverStep, apgd, apgd_checkpoints, apgd_search, average_case, drive,
                   random_search)

__all__ = ["SolverResult", "SolverStep", "apgd", "apgd_checkpoints", "apgd_search", "average_case", "drive",
           "random_search"]
