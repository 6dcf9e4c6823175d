"""Anomaly detection (AML §2), ROC/AUROC, and GMM Bayes classifiers (IML §13, §14.4)."""

import numpy as np
import pytest
import torch

from aml_ppl.analysis import (
    PCA,
    AnomalyDetector,
    GaussianMixtureClassifier,
    auroc,
    roc_curve,
)


def planted_anomalies(seed=0):
    """Normal points (2000): two clusters on a 2-d plane inside 10-d, plus small noise.
    Anomalies: 40 points uniform in a box around them."""
    generator = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(10, 2, dtype=torch.float64, generator=generator))[0]
    centres = torch.tensor([[-3.0, 0.0], [3.0, 1.0]], dtype=torch.float64)
    labels = torch.randint(2, (2000,), generator=generator)
    plane = centres[labels] + 0.7 * torch.randn(2000, 2, dtype=torch.float64, generator=generator)
    normal = plane @ basis.T + 0.05 * torch.randn(2000, 10, dtype=torch.float64, generator=generator)
    anomalies = (torch.rand(40, 10, dtype=torch.float64, generator=generator) - 0.5) * 16
    return normal, anomalies


def test_detector_separates_planted_anomalies():
    normal, anomalies = planted_anomalies()
    train, held_out = normal[:1000], normal[1000:]
    detector = AnomalyDetector(n_projection_dims=2, n_components=2, false_positive_rate=0.05).fit(train)
    assert detector.projection.explained_variance_ratio.sum() > 0.99
    scores = torch.cat([detector.score_samples(held_out), detector.score_samples(anomalies)])
    labels = torch.cat([torch.zeros(1000), torch.ones(40)])
    # Anomalies rank by -log p; the stated AUROC is 0.95.
    assert auroc(labels, -scores) > 0.95
    # The threshold flags about 5 % of normal points: binomial sd at n = 1000 is 0.7 %.
    flagged = (detector.predict(held_out) == -1).double().mean().item()
    assert flagged == pytest.approx(0.05, abs=0.03)


def test_roc_and_auroc_match_scikit_learn():
    from sklearn.metrics import roc_auc_score
    from sklearn.metrics import roc_curve as sklearn_roc

    generator = torch.Generator().manual_seed(3)
    labels = (torch.rand(300, generator=generator) < 0.3).long()
    scores = labels + torch.randn(300, generator=generator)
    scores[:20] = scores[20:40]  # ties
    fpr, tpr, _ = roc_curve(labels, scores)
    reference_fpr, reference_tpr, _ = sklearn_roc(labels.numpy(), scores.numpy(), drop_intermediate=False)
    np.testing.assert_allclose(fpr.numpy(), reference_fpr, atol=1e-12)
    np.testing.assert_allclose(tpr.numpy(), reference_tpr, atol=1e-12)
    assert auroc(labels, scores) == pytest.approx(roc_auc_score(labels.numpy(), scores.numpy()), abs=1e-12)


def test_pca_matches_scikit_learn():
    from sklearn.decomposition import PCA as SklearnPCA

    X = planted_anomalies()[0]
    ours = PCA(3).fit(X)
    reference = SklearnPCA(3).fit(X.numpy())
    np.testing.assert_allclose(ours.explained_variance.numpy(), reference.explained_variance_, rtol=1e-10)
    # Directions agree up to sign.
    np.testing.assert_allclose(np.abs(ours.components.numpy() @ reference.components_.T), np.eye(3), atol=1e-8)


@pytest.fixture
def three_classes():
    generator = torch.Generator().manual_seed(4)
    y = torch.randint(3, (300,), generator=generator)
    X = torch.randn(300, 4, dtype=torch.float64, generator=generator) * (1 + y[:, None]) + 2 * y[:, None]
    return X, y


def test_one_diagonal_component_is_gaussian_naive_bayes(three_classes):
    from sklearn.naive_bayes import GaussianNB

    X, y = three_classes
    reference = GaussianNB().fit(X.numpy(), y.numpy())
    # GaussianNB adds var_smoothing * max feature variance to every variance: our reg_covar.
    smoothing = 1e-9 * X.var(0, correction=0).max().item()
    ours = GaussianMixtureClassifier(1, covariance_type="diag", reg_covar=smoothing).fit(X, y)
    np.testing.assert_allclose(ours.predict_proba(X).numpy(), reference.predict_proba(X.numpy()), atol=1e-9)


def test_shared_covariance_is_lda(three_classes):
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

    X, y = three_classes
    reference = LinearDiscriminantAnalysis(solver="lsqr").fit(X.numpy(), y.numpy())
    ours = GaussianMixtureClassifier(1, shared_covariance=True, reg_covar=0.0).fit(X, y)
    np.testing.assert_allclose(ours.predict_proba(X).numpy(), reference.predict_proba(X.numpy()), atol=1e-8)


def test_mixture_classifier_beats_qda_on_bimodal_classes():
    """A class made of two blobs either side of the other: one Gaussian per class cannot fit it."""
    generator = torch.Generator().manual_seed(5)
    outer = torch.cat([torch.randn(200, 2, generator=generator) - 4, torch.randn(200, 2, generator=generator) + 4])
    inner = torch.randn(400, 2, generator=generator)
    X = torch.cat([outer, inner]).double()
    y = torch.cat([torch.zeros(400), torch.ones(400)]).long()
    mixture = GaussianMixtureClassifier(2).fit(X, y)
    qda = GaussianMixtureClassifier(1).fit(X, y)
    accuracy = lambda model: (model.predict(X) == y).double().mean().item()  # noqa: E731
    assert accuracy(mixture) > 0.95 and accuracy(mixture) > accuracy(qda)


def test_classifier_input_errors():
    with pytest.raises(ValueError, match="`y`"):
        GaussianMixtureClassifier().fit(torch.randn(5, 2, dtype=torch.float64), torch.zeros(4))
    with pytest.raises(ValueError, match="two classes"):
        GaussianMixtureClassifier().fit(torch.randn(5, 2, dtype=torch.float64), torch.zeros(5))
    with pytest.raises(ValueError, match="shared_covariance"):
        GaussianMixtureClassifier(2, shared_covariance=True)
