"""Maximisers over a ball of perturbations."""
from .apgd import SolverResult, SolverStep, apgd, apgd_checkpoints, average_case, random_search

__all__ = ["SolverResult", "SolverStep", "apgd", "apgd_checkpoints", "average_case", "random_search"]
