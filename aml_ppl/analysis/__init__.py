r"""What we do with a posterior: ArviZ summaries, LOO, plots, anomaly detection, classifiers."""

from aml_ppl.analysis.anomaly import PCA, AnomalyDetector, auroc, roc_curve
from aml_ppl.analysis.classification import GaussianMixtureClassifier
from aml_ppl.analysis.diagnostics import PointEstimateError, compare, loo, summary
from aml_ppl.analysis.plots import plot_predictive_1d

__all__ = [
    "PCA",
    "AnomalyDetector",
    "GaussianMixtureClassifier",
    "PointEstimateError",
    "auroc",
    "compare",
    "loo",
    "plot_predictive_1d",
    "roc_curve",
    "summary",
]
