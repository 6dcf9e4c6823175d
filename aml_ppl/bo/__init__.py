r"""Decisions under uncertainty on BoTorch: transductive acquisitions and safe BO.

BoTorch is imported only inside this subpackage: importing it changes
GPyTorch's settings for the whole process (``../shared/FACTS.md``).
"""

from aml_ppl.bo.acquisition import ITL, VTL, UncertaintySampling
from aml_ppl.bo.journal import EvaluationRecord, Journal, JournalContents, read_journal
from aml_ppl.bo.problems import SafeProblem
from aml_ppl.bo.safe import SafeBayesianOptimization

__all__ = [
    "EvaluationRecord",
    "ITL",
    "Journal",
    "JournalContents",
    "SafeBayesianOptimization",
    "SafeProblem",
    "UncertaintySampling",
    "VTL",
    "read_journal",
]
