r"""Decisions under uncertainty on BoTorch: transductive acquisitions and safe BO.

BoTorch is imported only inside this subpackage: importing it changes
GPyTorch's settings for the whole process (``../shared/FACTS.md``).
"""

from aml_ppl.bo.acquisition import ITL, VTL, UncertaintySampling

__all__ = ["ITL", "UncertaintySampling", "VTL"]
