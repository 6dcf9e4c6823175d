r"""``aml-ppl demo``: the library's main job end to end, with a self-contained HTML report.

Every model family is fitted on a data set that ships with scikit-learn or statsmodels (or
is generated here) by its default engine and one alternative, and scored on held-out
points; then a safe-BO loop runs with a journal and a resume. The run folder gets a PNG per
figure and ``report.html``, which embeds the figures and needs no network to view.
``quick=True`` is a smoke run (under a minute on a 2-core CPU); the full run trains to a
CPU budget of a few minutes, stated in the report. Needs the ``demo`` extra
(``pip install 'aml_ppl[demo]'``: scikit-learn, statsmodels).
"""

from __future__ import annotations

import base64
import html
import itertools
import math
import platform
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import torch

import aml_ppl as aml
from aml_ppl._core.files import atomic_write
from aml_ppl.errors import InputDataError
from aml_ppl.inference import EM, MAP, NUTS, SVI, Exact


@dataclass
class Section:
    title: str
    lines: list[str] = field(default_factory=list)
    figures: list[tuple[str, str]] = field(default_factory=list)  # (file name, caption)


@dataclass
class Report:
    r"""What the demo prints, the figures it saves and the comparison table, for the HTML report."""

    folder: Path
    quick: bool
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where the networks train
    sections: list[Section] = field(default_factory=list)
    rows: list[tuple[str, str, str, float, float, str]] = field(default_factory=list)

    def section(self, title: str) -> None:
        self.sections.append(Section(title))
        print(f"\n== {title} ==")

    def say(self, line: str) -> None:
        self.sections[-1].lines.append(line)
        print(line)

    def figure(self, figure: Any, name: str, caption: str) -> None:
        import matplotlib.pyplot as plt

        figure.savefig(self.folder / name, dpi=100, bbox_inches="tight")
        plt.close(figure)
        self.sections[-1].figures.append((name, caption))
        print(f"saved {caption} to {self.folder / name}")

    def timed_fit(self, family: str, data: str, model: Any, args: tuple, engine: Any, score: Callable[[Any], float],
                  key: Callable[[Any], str]) -> Any:
        r"""Fit, time, score on held-out data (mean log predictive density per point) and
        add a row to the comparison table."""
        start = time.perf_counter()
        posterior = aml.fit(model, *args, engine=engine, seed=0)
        seconds = time.perf_counter() - start
        held_out = score(posterior)
        self.rows.append((family, data, posterior.engine, seconds, held_out, key(posterior)))
        return posterior

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "the CPU"

    def write_html(self) -> Path:
        rows = "".join(
            f"<tr><td>{html.escape(family)}</td><td>{html.escape(data)}</td><td>{engine}</td><td>{seconds:.1f}</td>"
            f"<td>{held_out:.3f}</td><td>{html.escape(key)}</td></tr>"
            for family, data, engine, seconds, held_out, key in self.rows
        )
        body = []
        for section in self.sections:
            body.append(f"<h2>{html.escape(section.title)}</h2><pre>{html.escape(chr(10).join(section.lines))}</pre>")
            for name, caption in section.figures:
                encoded = base64.b64encode((self.folder / name).read_bytes()).decode()
                body.append(f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{encoded}">'
                            f"<figcaption>{html.escape(caption)} ({name})</figcaption></figure>")
        budget = ("quick smoke run: tiny budgets, numbers not meaningful" if self.quick
                  else "full run: networks trained to a CPU budget of a few minutes in all")
        page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>aml_ppl demo report</title>
<style>body{{font-family:sans-serif;max-width:960px;margin:2em auto;padding:0 1em}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}
pre{{background:#f6f6f6;padding:8px;overflow-x:auto}}img{{max-width:100%}}</style></head>
<body><h1>aml_ppl demo</h1>
<p>aml_ppl {aml.__version__}, torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} thread(s),
networks (BNN, DDPM) on {self.device_name()}, the rest on the CPU; {datetime.now():%Y-%m-%d %H:%M}. {budget}.</p>
<h2>Every model family: default engine and an alternative</h2>
<p>Held-out: the mean log predictive density per held-out point (nats; higher is better).</p>
<table><tr><th>model</th><th>data</th><th>engine</th><th>fit s</th><th>held-out log density</th><th>key parameter</th></tr>{rows}</table>
{"".join(body)}
<script>window.addEventListener("load", () => {{
  document.body.dataset.loadedFigures = [...document.images].filter(image => image.naturalWidth > 0).length;
}});</script>
</body></html>"""
        path = self.folder / "report.html"
        atomic_write(path, lambda file: file.write(page.encode("utf-8")))
        return path


def _split(count: int, held_out: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    return order[held_out:], order[:held_out]


def _cubic(x: torch.Tensor) -> torch.Tensor:
    r"""The basis :math:`[1, x, x^2, x^3]`: BLR is linear in :math:`\beta`, not in :math:`x`."""
    return torch.stack([x**0, x, x**2, x**3], dim=-1)


def linear_models(report: Report) -> None:
    import matplotlib.pyplot as plt
    from sklearn.datasets import load_breast_cancer

    report.section("Bayesian linear and logistic regression (AML §6, IML §11.3)")
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(60, dtype=torch.float64, generator=generator) * 4 - 2
    y = torch.sin(1.5 * x) + 0.2 * torch.randn(60, dtype=torch.float64, generator=generator)
    train, test = _split(60, 20)
    model = aml.models.BayesianLinearRegression(prior_precision=1.0, noise_scale=None)
    # 2 x 300 draws give the quick run's tail ESS room above the fit check's 100 on any
    # device's random stream (2 x 100 gave 95 for noise_precision on CUDA).
    draws = 300 if report.quick else 1000

    def score(posterior: Any) -> float:
        return posterior.log_prob(_cubic(x[test]), y[test]).mean().item()

    noise = lambda posterior: f"noise sd {posterior.sample(200)['noise_precision'].rsqrt().mean():.3f}"  # noqa: E731
    exact = report.timed_fit("BLR, cubic basis", "sin(1.5x) + noise", model, (_cubic(x[train]), y[train]), "exact", score, noise)
    nuts = report.timed_fit("BLR, cubic basis", "sin(1.5x) + noise", model, (_cubic(x[train]), y[train]),
                            NUTS(num_samples=draws, warmup_steps=draws, num_chains=2, progress_bar=False), score, noise)
    report.say("NUTS posterior, summarised by ArviZ:")
    report.say(aml.analysis.summary(nuts).to_string())
    grid = torch.linspace(-2.5, 2.5, 200, dtype=torch.float64)
    figure, axis = plt.subplots(figsize=(7, 4))
    for posterior, colour in ((exact, "C0"), (nuts, "C1")):
        prediction = posterior.predict(_cubic(grid))
        lower, upper = prediction.interval(0.95)
        axis.plot(grid, prediction.mean, colour, label=f"{posterior.engine}: predictive mean")
        axis.fill_between(grid, lower, upper, color=colour, alpha=0.2, label=f"{posterior.engine}: 95 % band")
    axis.scatter(x[train], y[train], s=12, c="k", label="training data")
    axis.set(xlabel="x", ylabel="y", title="Bayesian linear regression on a cubic basis")
    axis.legend(fontsize=8)
    report.figure(figure, "blr_predictive.png", "BLR predictive with its 95 % band, exact and NUTS")

    cancer = load_breast_cancer()
    X = torch.tensor(cancer.data[:, :10], dtype=torch.float64)
    labels = torch.tensor(cancer.target, dtype=torch.float64)
    train, test = _split(len(X), 169)
    X = (X - X[train].mean(0)) / X[train].std(0)
    logistic = aml.models.BayesianLogisticRegression(intercept=True)
    accuracy = lambda posterior: f"accuracy {((posterior.predict(X[test], site='probs').mean > 0.5).double() == labels[test]).double().mean():.3f}"  # noqa: E731
    held_out = lambda posterior: posterior.log_prob(X[test], labels[test]).mean().item()  # noqa: E731
    report.timed_fit("logistic regression", "breast cancer, 10 features", logistic, (X[train], labels[train]), "map", held_out, accuracy)
    report.timed_fit("logistic regression", "breast cancer, 10 features", logistic, (X[train], labels[train]),
                     NUTS(num_samples=draws // 2, warmup_steps=draws // 2, progress_bar=False), held_out, accuracy)


def mixtures(report: Report) -> None:
    import matplotlib.pyplot as plt
    from sklearn.datasets import load_breast_cancer, load_iris

    report.section("Gaussian mixtures by EM and by SVI, anomaly detection (AML §2, IML §14)")
    iris = load_iris()
    X = torch.tensor(iris.data, dtype=torch.float64)
    species = torch.tensor(iris.target)
    train, test = _split(len(X), 30)
    model = aml.models.GaussianMixture(3, covariance_type="full", reg_covar=1e-4)
    score = lambda posterior: posterior.log_prob(X[test], num_samples=10).mean().item()  # noqa: E731
    weights = lambda posterior: "weights " + ", ".join(f"{w:.2f}" for w in posterior.sample(1)["weights"][0].sort().values.tolist())  # noqa: E731
    em = report.timed_fit("Gaussian mixture, k = 3", "iris", model, (X[train],), EM(n_init=5, progress_bar=False), score, weights)
    report.timed_fit("Gaussian mixture, k = 3", "iris", model, (X[train],),
                     SVI(num_steps=100 if report.quick else 1500, lr=0.05, progress_bar=False), score, weights)
    for k in (2, 3, 4):
        bic = aml.fit(aml.models.GaussianMixture(k, reg_covar=1e-4), X, engine=EM(n_init=3, progress_bar=False), seed=0).bic(X)
        report.say(f"k = {k}: BIC {bic:8.1f}")
    labels = em.predict_labels(X)
    agreement = max((labels == permutation[species]).double().mean().item()
                    for permutation in torch.tensor(list(itertools.permutations(range(3)))))
    report.say(f"EM clusters agree with the species on {100 * agreement:.0f} % of flowers")

    cancer = load_breast_cancer()
    features = torch.tensor(cancer.data, dtype=torch.float64)
    features = (features - features.mean(0)) / features.std(0)
    benign, malignant = features[torch.tensor(cancer.target == 1)], features[torch.tensor(cancer.target == 0)]
    kept, held_out = _split(len(benign), len(benign) - 250)
    detector = aml.analysis.AnomalyDetector(n_projection_dims=2, n_components=2).fit(benign[kept])
    scores = -torch.cat([detector.score_samples(benign[held_out]), detector.score_samples(malignant)])
    truth = torch.cat([torch.zeros(len(held_out)), torch.ones(len(malignant))])
    false_positive_rates, true_positive_rates, _ = aml.analysis.roc_curve(truth, scores)
    area = aml.analysis.auroc(truth, scores)
    report.say(f"anomaly detection (PCA + GMM) trained on 250 benign cells: AUROC {area:.3f} against malignant ones")
    figure, axis = plt.subplots(figsize=(4.5, 4.5))
    axis.plot(false_positive_rates, true_positive_rates, label=f"PCA(2) + GMM(2), AUROC {area:.3f}")
    axis.plot([0, 1], [0, 1], "k:", label="chance")
    axis.set(xlabel="false-positive rate", ylabel="true-positive rate", title="Malignant cells as anomalies")
    axis.legend(loc="lower right", fontsize=8)
    report.figure(figure, "anomaly_roc.png", "ROC curve of the anomaly detector")


def co2_kernel() -> Any:
    r"""The Mauna Loa kernel in years: a long-term trend + a decaying yearly cycle +
    medium-term irregularities (AML §6.1)."""
    from gpytorch.kernels import PeriodicKernel, RBFKernel, RQKernel, ScaleKernel

    seasonal = PeriodicKernel().double() * RBFKernel().double()
    seasonal.kernels[0].initialize(period_length=torch.tensor(1.0, dtype=torch.float64))
    seasonal.kernels[1].initialize(lengthscale=torch.tensor(50.0, dtype=torch.float64))
    trend = ScaleKernel(RBFKernel()).double()
    trend.base_kernel.initialize(lengthscale=torch.tensor(50.0, dtype=torch.float64))
    return trend + ScaleKernel(seasonal).double() + ScaleKernel(RQKernel()).double()


def co2_series(step: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The Mauna Loa CO2 series (statsmodels' weekly record as monthly means) every
    ``step``-th month: years since 1958 (``n x 1``) and ppm (``n``)."""
    import statsmodels.api as sm

    monthly = sm.datasets.co2.load_pandas().data["co2"].resample("MS").mean().dropna().iloc[::step]
    years = torch.tensor(monthly.index.year + (monthly.index.month - 1) / 12, dtype=torch.float64)
    return (years - 1958.0)[:, None], torch.tensor(monthly.to_numpy(), dtype=torch.float64)


def gaussian_process(report: Report) -> None:
    import matplotlib.pyplot as plt
    report.section("Gaussian process on the Mauna Loa CO2 series (AML §6)")
    X, y = co2_series(6 if report.quick else 1)
    train, test = _split(len(y), len(y) // 10)

    score = lambda posterior: posterior.log_prob(X[test], y[test]).mean().item()  # noqa: E731
    noise = lambda posterior: f"noise sd {posterior.sample(1)['likelihood.noise_covar.noise'].sqrt().item():.3f}"  # noqa: E731
    post = report.timed_fit("GP, composite kernel", "CO2, monthly", aml.models.GaussianProcess(co2_kernel()), (X[train], y[train]),
                            Exact(num_restarts=2 if report.quick else 8), score,
                            lambda posterior: f"log marginal likelihood {posterior.log_marginal_likelihood.item():.1f}")
    centred = y[train].mean()
    report.timed_fit("GP, composite kernel", "CO2, monthly (centred)", aml.models.GaussianProcess(co2_kernel()), (X[train], y[train] - centred),
                     MAP(num_steps=50 if report.quick else 300, progress_bar=False),
                     lambda posterior: posterior.log_prob(X[test], y[test] - centred).mean().item(), noise)
    grid = torch.linspace(0, 52, 600, dtype=torch.float64)[:, None]
    figure, axis = plt.subplots(figsize=(8, 4))
    aml.analysis.plot_predictive_1d(post, grid, ax=axis)
    axis.set(xlabel="years since 1958", ylabel="CO2 (ppm)", title="GP with a composite kernel, 95 % band (cf. AML Figure 6.1)")
    forecast = post.predict(torch.tensor([[50.0]], dtype=torch.float64))
    lower, upper = forecast.interval(0.95)
    report.say(f"forecast for 2008: {forecast.mean.item():.1f} ppm (95 %: {lower.item():.1f} to {upper.item():.1f})")
    report.figure(figure, "gp_co2.png", "GP predictive for the CO2 series")


def neural_networks(report: Report) -> None:
    import matplotlib.pyplot as plt
    from sklearn.datasets import load_breast_cancer

    report.section("Bayesian neural networks (AML §7.4)")
    steps = 200 if report.quick else 3000
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(300, generator=generator) * 2 - 4, torch.rand(300, generator=generator) * 2 + 2])
    y = torch.sin(x) + 0.1 * torch.randn(600, generator=generator)
    net = aml.models.BayesianNeuralNetwork(1, hidden=(50,), activation="tanh")
    post = aml.fit(net, x[:, None].to(report.device), y.to(report.device), seed=0)  # its default: the linearised Laplace
    grid = torch.linspace(-6, 6, 300)
    split = aml.analysis.regression_uncertainty(post, grid[:, None].to(report.device), num_samples=500)
    mean, total, epistemic = (values.cpu() for values in (split.mean, 1.96 * split.total.sqrt(), 1.96 * split.epistemic.sqrt()))
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.fill_between(grid, mean - total, mean + total, color="C0", alpha=0.2, label="95 %: total")
    axis.fill_between(grid, mean - epistemic, mean + epistemic, color="C1", alpha=0.4, label="95 %: epistemic")
    axis.plot(grid, mean, "C0", label="predictive mean")
    axis.plot(x, y, "k.", ms=2, label="data")
    axis.set(xlabel="x", ylabel="y", title="BNN (linearised Laplace): epistemic and aleatoric parts of the predictive")
    axis.legend(loc="lower left", fontsize=8)
    report.figure(figure, "bnn_regression_band.png", "BNN predictive band with its epistemic part")

    data = load_breast_cancer()
    X = torch.tensor(data.data, dtype=torch.float32)
    labels = torch.tensor(data.target, dtype=torch.float32)
    train, test = _split(len(X), len(X) - 400)
    X = ((X - X[train].mean(0)) / X[train].std(0)).to(report.device)
    labels = labels.to(report.device)
    classifier = aml.models.BayesianNeuralNetwork(X.shape[1], hidden=(32,), out_features=2, likelihood="categorical")
    score = lambda posterior: posterior.log_prob(X[test], labels[test], num_samples=200).mean().item()  # noqa: E731

    def accuracy(posterior: Any) -> str:
        probs = aml.analysis.classification_uncertainty(posterior, X[test], num_samples=200).probs
        return f"accuracy {aml.analysis.accuracy(probs, labels[test]):.3f}, ECE {aml.analysis.expected_calibration_error(probs, labels[test]):.3f}"

    bayes = report.timed_fit("BNN classifier, 30-32-2", "breast cancer", classifier, (X[train], labels[train]),
                             None, score, accuracy)  # its default: the Laplace over the output layer, the prior refitted
    report.say("BNN classifier: its default engine is the Laplace approximation over the output layer, around the MAP "
               "under the prior scale the network's evidence chooses")
    report.timed_fit("BNN classifier, 30-32-2", "breast cancer", classifier, (X[train], labels[train]),
                     SVI(num_steps=steps, lr=0.01, progress_bar=False), score, accuracy)
    report.timed_fit("BNN classifier, 30-32-2", "breast cancer", classifier, (X[train], labels[train]),
                     MAP(optim="adam", num_steps=steps, lr=0.01, progress_bar=False), score, accuracy)
    probs = aml.analysis.classification_uncertainty(bayes, X[test], num_samples=500).probs
    axis = aml.analysis.plot_reliability_diagram(probs.cpu(), labels[test].cpu())
    report.figure(axis.figure, "bnn_reliability.png", "reliability diagram of the BNN classifier's default fit (held out)")


def diffusion(report: Report) -> None:
    import matplotlib.pyplot as plt
    from sklearn.datasets import make_moons

    report.section("A DDPM as a latent-variable model (AML §10.1)")
    train = torch.tensor(make_moons(4000, noise=0.1, random_state=0)[0], dtype=torch.float32, device=report.device)
    held_out = torch.tensor(make_moons(1000, noise=0.1, random_state=1)[0], dtype=torch.float32, device=report.device)
    steps, timesteps = (200, 100) if report.quick else (4000, 1000)
    model = aml.models.DDPM((2,), num_timesteps=timesteps, batch_size=512)
    score = lambda posterior: posterior.log_prob(held_out).mean().item()  # noqa: E731
    engine = SVI(**{**aml.models.DDPM.default_engine_options, "num_steps": steps, "progress_bar": False})
    post = report.timed_fit("DDPM, MLP denoiser", "two moons", model, (train,), engine,
                            score, lambda posterior: f"T = {timesteps} (its only engine: SVI)")
    bits = -report.rows[-1][4] / (2 * math.log(2))
    generated = post.predict(num_samples=1000, seed=0, progress_bar=False).samples
    report.say(f"two moons, held out: bound {bits:.3f} bits/dim (the data's entropy: 0.726 bits/dim); "
               f"energy distance to held-out points {aml.analysis.energy_distance(generated, held_out):.4f}; "
               f"trained on {report.device_name()}")
    generated, held_out = generated.cpu(), held_out.cpu()
    figure, axes = plt.subplots(1, 2, figsize=(9, 4), sharex=True, sharey=True)
    axes[0].plot(*held_out.T, "k.", ms=2)
    axes[0].set(title="held-out data")
    axes[1].plot(*generated.T, "C0.", ms=2)
    axes[1].set(title=f"DDPM samples (T = {timesteps}, Algorithm 2)")
    report.figure(figure, "ddpm_two_moons.png", "DDPM samples beside held-out points")


def safe_optimisation(report: Report) -> None:
    import matplotlib.pyplot as plt

    from aml_ppl.bo import SafeBayesianOptimization
    from aml_ppl.bo.plots import plot_progress, plot_safe_bo_1d
    from aml_ppl.bo.problems import one_d_hard

    report.section("Safe Bayesian optimisation with ITL on 1d_hard (AML §7.5)")
    problem = one_d_hard()
    generator = torch.Generator().manual_seed(0)
    journal = Path(tempfile.mkdtemp()) / "journal.sqlite"
    loop = SafeBayesianOptimization(problem, journal=journal)
    seeds = problem.seed_points(generator=generator)
    loop.add_seed(seeds, problem.observe(seeds, generator))

    def objective(x: torch.Tensor) -> torch.Tensor:
        return problem.observe(x[None], generator)[0]

    first, total = (10, 20) if report.quick else (150, 400)
    loop.run(objective, budget=first, progress_bar=False)
    loop.journal.close()
    resumed = SafeBayesianOptimization.resume(journal, problem)
    report.say(f"ran {first} evaluations into a journal; a fresh loop resumed with {len(resumed.records)} records "
               f"(8 seeds + {first}) and continued to {total}")
    resumed.run(objective, budget=total, progress_bar=False)
    recommendation = resumed.recommendation()
    X = torch.tensor([record.x for record in resumed.records])
    report.say(f"recommendation x = {recommendation.item():.2f}, simple regret {problem.simple_regret(recommendation):.4f}, "
               f"unsafe evaluations {int((~problem.safe_mask(X)).sum())}")
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7))
    plot_safe_bo_1d(resumed, top, problem)
    top.set_title("Safe BO on 1d_hard (cf. AML Figure 7.2)")
    plot_progress(resumed, problem, bottom)
    report.figure(figure, "safe_bo_1d_hard.png", "safe BO: sets, evaluations and progress")


TOURS = (linear_models, mixtures, gaussian_process, neural_networks, diffusion, safe_optimisation)


def run_demo(out: Path | str = "aml-ppl-demo", quick: bool = False, device: str = "auto") -> Path:
    r"""Run every tour into a new folder under ``out`` and write its report.

    Args:
        out: The folder that gets the run folder.
        quick: A smoke run with tiny budgets.
        device: Where the networks (BNN, DDPM) train: ``"auto"`` (CUDA when there is a GPU),
            ``"cpu"`` or ``"cuda"``; the small models run on the CPU either way.

    Returns:
        The path of ``report.html``.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise InputDataError(f"`device` must be 'auto', 'cpu' or 'cuda'; got {device!r}.")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputDataError("--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False).")
    chosen = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    for needed in ("sklearn", "statsmodels"):
        try:
            __import__(needed)
        except ImportError as error:
            raise InputDataError(f"the demo needs {needed}: pip install 'aml_ppl[demo]' ({error}).") from error
    import matplotlib

    matplotlib.use("Agg")
    folder = Path(out) / f"run-{datetime.now():%Y%m%d-%H%M%S}"
    folder.mkdir(parents=True, exist_ok=False)
    report = Report(folder, quick, chosen)
    for tour in TOURS:
        tour(report)
    print("\n== Every model family: default engine and an alternative (held-out mean log density) ==")
    for family, data, engine, seconds, held_out, key in report.rows:
        print(f"{family:28s} {data:26s} {engine:6s} {seconds:7.1f} s  {held_out:9.3f}  {key}")
    return report.write_html()
