r"""What we do with a posterior: ArviZ summaries and model comparison."""

from aml_ppl.analysis.diagnostics import loo, summary

__all__ = ["loo", "summary"]
