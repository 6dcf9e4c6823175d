"""A short tour of aml_ppl: Bayesian linear regression two ways, mixtures, anomaly detection, GPs, BNNs, a DDPM, safe BO.

Run with `make demo` (or `python examples/demo.py --out out`). `--smoke` makes it
quick enough to run as a test.
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import aml_ppl as aml  # noqa: E402
from aml_ppl.inference import EM, NUTS, SVI  # noqa: E402


def save(figure, path: Path, what: str) -> None:
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    print(f"saved {what} to {path}")


def features(x: torch.Tensor) -> torch.Tensor:
    """A cubic basis [1, x, x², x³]: BLR is linear in β, not in x."""
    return torch.stack([x**0, x, x**2, x**3], dim=-1)


def blr_tour(out: Path, smoke: bool) -> None:
    print("== Bayesian linear regression (notes AML §6) ==")
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(40, dtype=torch.float64, generator=generator) * 4 - 2
    y = torch.sin(1.5 * x) + 0.2 * torch.randn(40, dtype=torch.float64, generator=generator)
    model = aml.models.BayesianLinearRegression(prior_precision=1.0, noise_scale=None)

    exact = aml.fit(model, features(x), y, engine="exact")
    noise = exact.latents.fixed["noise_precision"].rsqrt().item()
    print(f"exact: evidence-maximised noise sd {noise:.3f}, "
          f"log marginal likelihood {exact.log_marginal_likelihood.item():.2f}")

    draws = 100 if smoke else 1000
    nuts = aml.fit(
        model, features(x), y, seed=0,
        engine=NUTS(num_samples=draws, warmup_steps=draws, num_chains=2, progress_bar=False),
    )
    print("NUTS posterior, summarised by ArviZ:")
    print(aml.analysis.summary(nuts).to_string())

    grid = torch.linspace(-2.5, 2.5, 200, dtype=torch.float64)
    figure, axis = plt.subplots(figsize=(7, 4))
    for posterior, colour in ((exact, "C0"), (nuts, "C1")):
        prediction = posterior.predict(features(grid))
        lower, upper = prediction.interval(0.95)
        axis.plot(grid, prediction.mean, colour, label=f"{posterior.engine}: predictive mean")
        axis.fill_between(grid, lower, upper, color=colour, alpha=0.2, label=f"{posterior.engine}: 95 % band")
    axis.scatter(x, y, s=12, c="k", label="data")
    axis.set(xlabel="x", ylabel="y", title="Bayesian linear regression on a cubic basis")
    axis.legend(fontsize=8)
    save(figure, out / "blr_predictive.png", "the predictive with its 95 % band")


def mixture_tour(out: Path, smoke: bool) -> None:
    from sklearn.datasets import load_breast_cancer, load_iris

    print("\n== Gaussian mixture by EM and by SVI (notes AML §2, IML §14) ==")
    iris = load_iris()
    X = torch.tensor(iris.data, dtype=torch.float64)
    species = torch.tensor(iris.target)
    model = aml.models.GaussianMixture(3, covariance_type="full", reg_covar=1e-4)
    em = aml.fit(model, X, engine=EM(n_init=5), seed=0)
    svi = aml.fit(model, X, engine=SVI(num_steps=100 if smoke else 1500, lr=0.05, progress_bar=False), seed=0)
    print(f"iris, k = 3: EM mean log-likelihood {em.score(X):.3f} after {len(em.history) - 1} "
          f"iterations; SVI (z enumerated) {svi.log_prob(X, num_samples=5).mean():.3f}")
    for k in (2, 3, 4):
        print(f"  k = {k}: BIC {aml.fit(aml.models.GaussianMixture(k, reg_covar=1e-4), X, engine=EM(n_init=3), seed=0).bic(X):8.1f}")
    labels = em.predict_labels(X)
    agreement = max(
        (labels == permutation[species]).double().mean().item()
        for permutation in torch.tensor(list(itertools.permutations(range(3))))
    )
    print(f"  EM clusters agree with the species on {100 * agreement:.0f} % of flowers")

    print("\n== Anomaly detection: PCA + GMM (AML §2) on breast-cancer cells ==")
    cancer = load_breast_cancer()
    features = torch.tensor(cancer.data, dtype=torch.float64)
    features = (features - features.mean(0)) / features.std(0)
    benign = features[torch.tensor(cancer.target == 1)]
    malignant = features[torch.tensor(cancer.target == 0)]
    order = torch.randperm(len(benign), generator=torch.Generator().manual_seed(0))
    train, held_out = benign[order[:250]], benign[order[250:]]
    detector = aml.analysis.AnomalyDetector(n_projection_dims=2, n_components=2).fit(train)
    scores = -torch.cat([detector.score_samples(held_out), detector.score_samples(malignant)])
    truth = torch.cat([torch.zeros(len(held_out)), torch.ones(len(malignant))])
    false_positive_rates, true_positive_rates, _ = aml.analysis.roc_curve(truth, scores)
    area = aml.analysis.auroc(truth, scores)
    print(f"trained on {len(train)} benign samples; held-out benign {len(held_out)}, malignant "
          f"{len(malignant)}: AUROC {area:.3f}")
    figure, axis = plt.subplots(figsize=(4.5, 4.5))
    axis.plot(false_positive_rates, true_positive_rates, label=f"PCA(2) + GMM(2), AUROC {area:.3f}")
    axis.plot([0, 1], [0, 1], "k:", label="chance")
    axis.set(xlabel="false-positive rate", ylabel="true-positive rate", title="Malignant cells as anomalies")
    axis.legend(loc="lower right", fontsize=8)
    save(figure, out / "anomaly_roc.png", "the ROC curve")


def gp_tour(out: Path, smoke: bool) -> None:
    import statsmodels.api as sm
    from gpytorch.kernels import PeriodicKernel, RBFKernel, RQKernel, ScaleKernel

    print("\n== Gaussian process on the Mauna Loa CO2 series (notes AML §6) ==")
    weekly = sm.datasets.co2.load_pandas().data["co2"]
    monthly = weekly.resample("MS").mean().dropna()
    if smoke:
        monthly = monthly.iloc[::6]
    years = torch.tensor(monthly.index.year + (monthly.index.month - 1) / 12, dtype=torch.float64)
    X, y = (years - 1958.0)[:, None], torch.tensor(monthly.to_numpy(), dtype=torch.float64)

    def scaled(kernel, **values):
        kernel = ScaleKernel(kernel).double()
        kernel.base_kernel.initialize(**{k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()})
        return kernel

    # A long-term trend + a decaying yearly cycle + medium-term irregularities: the sum and
    # product rules of AML §6.1.
    seasonal = PeriodicKernel().double() * RBFKernel().double()
    seasonal.kernels[0].initialize(period_length=torch.tensor(1.0, dtype=torch.float64))
    seasonal.kernels[1].initialize(lengthscale=torch.tensor(50.0, dtype=torch.float64))
    kernel = scaled(RBFKernel(), lengthscale=50.0) + ScaleKernel(seasonal).double() + scaled(RQKernel(), lengthscale=1.0)
    model = aml.models.GaussianProcess(kernel, standardize_outputs=True)
    post = aml.fit(model, X, y, engine=aml.inference.Exact(num_restarts=2 if smoke else 8), seed=0)
    print(f"{len(y)} monthly means, 1958-2001: log marginal likelihood {post.log_marginal_likelihood.item():.1f}")
    grid = torch.linspace(0, 52, 600, dtype=torch.float64)[:, None]
    figure, axis = plt.subplots(figsize=(8, 4))
    aml.analysis.plot_predictive_1d(post, grid, ax=axis)
    axis.set(xlabel="years since 1958", ylabel="CO2 (ppm)", title="GP with a composite kernel, 95 % band (cf. AML Figure 6.1)")
    forecast = post.predict(torch.tensor([[50.0]], dtype=torch.float64))
    lower, upper = forecast.interval(0.95)
    print(f"forecast for 2008: {forecast.mean.item():.1f} ppm (95 %: {lower.item():.1f} to {upper.item():.1f})")
    save(figure, out / "gp_co2.png", "the GP's predictive")


def safe_bo_tour(out: Path, smoke: bool) -> None:
    import tempfile

    from aml_ppl.bo import SafeBayesianOptimization
    from aml_ppl.bo.plots import plot_progress, plot_safe_bo_1d
    from aml_ppl.bo.problems import one_d_hard

    print("\n== Safe Bayesian optimisation with ITL on 1d_hard (notes AML §7.5) ==")
    problem = one_d_hard()
    generator = torch.Generator().manual_seed(0)
    journal = Path(tempfile.mkdtemp()) / "journal.sqlite"
    loop = SafeBayesianOptimization(problem, journal=journal)
    seeds = problem.seed_points(generator=generator)
    loop.add_seed(seeds, problem.observe(seeds, generator))

    def objective(x: torch.Tensor) -> torch.Tensor:
        return problem.observe(x[None], generator)[0]

    first, total = (10, 20) if smoke else (150, 400)
    loop.run(objective, budget=first, progress_bar=False)
    print(f"ran {first} evaluations, journal {journal}; a fresh loop resumes from the file alone:")
    resumed = SafeBayesianOptimization.resume(journal, problem)
    print(f"  resumed with {len(resumed.records)} records (8 seeds + {first}); continuing to {total}")
    resumed.run(objective, budget=total, progress_bar=False)
    recommendation = resumed.recommendation()
    regret = problem.simple_regret(recommendation)
    X = torch.tensor([record.x for record in resumed.records])
    print(f"recommendation x = {recommendation.item():.2f}, simple regret {regret:.4f}, "
          f"unsafe evaluations {int((~problem.safe_mask(X)).sum())}")
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7))
    plot_safe_bo_1d(resumed, top, problem)
    top.set_title("Safe BO on 1d_hard (cf. AML Figure 7.2)")
    plot_progress(resumed, problem, bottom)
    save(figure, out / "safe_bo_1d_hard.png", "the safe-BO figure")


def bnn_tour(out: Path, smoke: bool) -> None:
    print("== Bayesian neural networks (notes AML §7.4) ==")
    from sklearn.datasets import load_breast_cancer

    steps = 200 if smoke else 3000
    # 1-d regression with a gap in the inputs: epistemic uncertainty grows where no data are.
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(300, generator=generator) * 2 - 4, torch.rand(300, generator=generator) * 2 + 2])
    y = torch.sin(x) + 0.1 * torch.randn(600, generator=generator)
    net = aml.models.BayesianNeuralNetwork(1, hidden=(50,), activation="tanh")
    post = aml.fit(net, x[:, None], y, engine=SVI(num_steps=steps, lr=0.01, progress_bar=False), seed=0)
    grid = torch.linspace(-6, 6, 300)
    split = aml.analysis.regression_uncertainty(post, grid[:, None], num_samples=500)
    figure, axis = plt.subplots(figsize=(7, 4))
    total, epistemic = 1.96 * split.total.sqrt(), 1.96 * split.epistemic.sqrt()
    axis.fill_between(grid, split.mean - total, split.mean + total, color="C0", alpha=0.2, label="95 %: total")
    axis.fill_between(grid, split.mean - epistemic, split.mean + epistemic, color="C1", alpha=0.4, label="95 %: epistemic")
    axis.plot(grid, split.mean, "C0", label="predictive mean")
    axis.plot(x, y, "k.", ms=2, label="data")
    axis.set(xlabel="x", ylabel="y", title="BNN: epistemic and aleatoric parts of the predictive")
    axis.legend(loc="lower left", fontsize=8)
    save(figure, out / "bnn_regression_band.png", "the BNN's predictive band")

    # Classification on scikit-learn's breast-cancer set: calibration of the predictive.
    data = load_breast_cancer()
    X = torch.tensor(data.data, dtype=torch.float32)
    labels = torch.tensor(data.target, dtype=torch.float32)
    order = torch.randperm(X.shape[0], generator=generator)
    train, test = order[:400], order[400:]
    X = (X - X[train].mean(0)) / X[train].std(0)
    classifier = aml.models.BayesianNeuralNetwork(X.shape[1], hidden=(32,), out_features=2, likelihood="categorical")
    post = aml.fit(classifier, X[train], labels[train], engine=SVI(num_steps=steps, lr=0.01, progress_bar=False), seed=0)
    uncertainty = aml.analysis.classification_uncertainty(post, X[test], num_samples=500)
    accuracy = aml.analysis.accuracy(uncertainty.probs, labels[test])
    print(f"breast cancer, held out: accuracy {accuracy:.3f}, "
          f"ECE {aml.analysis.expected_calibration_error(uncertainty.probs, labels[test]):.3f}")
    axis = aml.analysis.plot_reliability_diagram(uncertainty.probs, labels[test])
    save(axis.figure, out / "bnn_reliability.png", "the BNN's reliability diagram")


def ddpm_tour(out: Path, smoke: bool) -> None:
    print("== A DDPM as a latent-variable model (notes AML §10.1) ==")
    from sklearn.datasets import make_moons

    train = torch.tensor(make_moons(4000, noise=0.1, random_state=0)[0], dtype=torch.float32)
    held_out = torch.tensor(make_moons(1000, noise=0.1, random_state=1)[0], dtype=torch.float32)
    steps, timesteps = (200, 100) if smoke else (4000, 1000)
    model = aml.models.DDPM((2,), num_timesteps=timesteps, batch_size=256)
    post = aml.fit(model, train, engine=SVI(num_steps=steps, lr=2e-3, progress_bar=False), seed=0)
    bits = -post.log_prob(held_out).mean().item() / (2 * math.log(2))
    generated = post.predict(num_samples=1000, seed=0, progress_bar=False).samples
    print(f"two moons, held out: bound {bits:.3f} bits/dim (the data's entropy: 0.726 bits/dim); "
          f"energy distance to held-out points {aml.analysis.energy_distance(generated, held_out):.4f}")
    figure, axes = plt.subplots(1, 2, figsize=(9, 4), sharex=True, sharey=True)
    axes[0].plot(*held_out.T, "k.", ms=2)
    axes[0].set(title="held-out data")
    axes[1].plot(*generated.T, "C0.", ms=2)
    axes[1].set(title=f"DDPM samples (T = {timesteps}, Algorithm 2)")
    save(figure, out / "ddpm_two_moons.png", "the DDPM's samples beside real ones")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for figures")
    parser.add_argument("--smoke", action="store_true", help="tiny budgets, for tests")
    options = parser.parse_args(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    blr_tour(options.out, options.smoke)
    mixture_tour(options.out, options.smoke)
    gp_tour(options.out, options.smoke)
    bnn_tour(options.out, options.smoke)
    ddpm_tour(options.out, options.smoke)
    safe_bo_tour(options.out, options.smoke)


if __name__ == "__main__":
    main()
