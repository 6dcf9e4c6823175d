r"""What we do with a posterior: ArviZ summaries, LOO, calibration, decisions, plots,
anomaly detection, classifiers."""

from aml_ppl.analysis.anomaly import PCA, AnomalyDetector, auroc, roc_curve
from aml_ppl.analysis.classification import GaussianMixtureClassifier
from aml_ppl.analysis.decisions import ABSTAIN, bayes_optimal_action, uncertainty_sampling
from aml_ppl.analysis.diagnostics import ParetoKWarning, PointEstimateError, compare, loo, plot_ppc, summary
from aml_ppl.analysis.metrics import (
    ClassificationUncertainty,
    RegressionUncertainty,
    accuracy,
    calibration_bins,
    classification_uncertainty,
    expected_calibration_error,
    negative_log_likelihood,
    plot_reliability_diagram,
    regression_uncertainty,
    rmse,
)
from aml_ppl.analysis.linear import LeastSquaresFit, least_squares
from aml_ppl.analysis.plots import plot_predictive_1d
from aml_ppl.analysis.two_sample import energy_distance, mmd
from aml_ppl.analysis.validation import RiskEstimate, bootstrap_632, cross_validate, negative_log_predictive

__all__ = [
    "ABSTAIN",
    "PCA",
    "AnomalyDetector",
    "ClassificationUncertainty",
    "LeastSquaresFit",
    "GaussianMixtureClassifier",
    "ParetoKWarning",
    "PointEstimateError",
    "RegressionUncertainty",
    "RiskEstimate",
    "accuracy",
    "auroc",
    "bayes_optimal_action",
    "bootstrap_632",
    "calibration_bins",
    "classification_uncertainty",
    "compare",
    "cross_validate",
    "energy_distance",
    "expected_calibration_error",
    "least_squares",
    "loo",
    "mmd",
    "negative_log_predictive",
    "negative_log_likelihood",
    "plot_ppc",
    "plot_predictive_1d",
    "plot_reliability_diagram",
    "regression_uncertainty",
    "rmse",
    "roc_curve",
    "summary",
    "uncertainty_sampling",
]
