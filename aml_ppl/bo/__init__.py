r"""Decisions under uncertainty on BoTorch: safe Bayesian optimisation and ITL.

BoTorch is imported only inside this subpackage: importing it changes
GPyTorch's settings for the whole process (``../shared/FACTS.md``).
"""
