r"""What we do with a posterior: ArviZ summaries, LOO, anomaly detection, classifiers."""

from aml_ppl.analysis.anomaly import PCA, AnomalyDetector, auroc, roc_curve
from aml_ppl.analysis.classification import GaussianMixtureClassifier
from aml_ppl.analysis.diagnostics import loo, summary

__all__ = [
    "PCA",
    "AnomalyDetector",
    "GaussianMixtureClassifier",
    "auroc",
    "loo",
    "roc_curve",
    "summary",
]
