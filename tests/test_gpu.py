"""Data on CUDA: the work follows the data's device, and agrees with the CPU (`make gpu-check`).

Skipped where CUDA is absent (tests/conftest.py).
"""

import arviz as az
import pyro
import pyro.distributions as dist
import pytest
import torch

import aml_ppl as aml
from aml_ppl.inference import EM, NUTS, SVI, ChEES, Exact

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def data(n=200, d=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, dtype=torch.float64, generator=generator)
    y = X @ torch.arange(1.0, d + 1, dtype=torch.float64) + 0.3 * torch.randn(n, dtype=torch.float64, generator=generator)
    return X, y


def test_exact_blr_on_cuda_matches_the_cpu():
    X, y = data()
    model = aml.models.BayesianLinearRegression(noise_scale=None)
    cpu, gpu = aml.fit(model, X, y), aml.fit(model, X.to(CUDA), y.to(CUDA))
    assert gpu.latents.loc["beta"].device.type == "cuda"
    torch.testing.assert_close(gpu.latents.loc["beta"].cpu(), cpu.latents.loc["beta"])
    idata = gpu.to_arviz(num_samples=100)
    assert idata.log_likelihood["obs"].shape == (1, 100, 200)


def test_em_on_cuda_matches_the_cpu():
    X = torch.cat([data(100, 2, 1)[0] - 3, data(100, 2, 2)[0] + 3])
    start = aml.fit(aml.models.GaussianMixture(2), X, engine=EM(max_iter=1), seed=0).params
    engine = EM(init={k: v for k, v in start.items()}, max_iter=20, tol=0)
    cpu = aml.fit(aml.models.GaussianMixture(2), X, engine=engine)
    gpu = aml.fit(aml.models.GaussianMixture(2), X.to(CUDA), engine=EM(init={k: v.to(CUDA) for k, v in start.items()}, max_iter=20, tol=0))
    assert gpu.params["means"].device.type == "cuda"
    torch.testing.assert_close(gpu.params["means"].cpu(), cpu.params["means"])


def test_exact_gp_on_cuda_matches_the_cpu():
    X, y = data(150, 2)
    cpu = aml.fit(aml.models.GaussianProcess(), X, y, engine=Exact(learn=False))
    gpu = aml.fit(aml.models.GaussianProcess(), X.to(CUDA), y.to(CUDA), engine=Exact(learn=False))
    prediction = gpu.predict(X[:5].to(CUDA))
    assert prediction.mean.device.type == "cuda"
    torch.testing.assert_close(prediction.mean.cpu(), cpu.predict(X[:5]).mean)
    assert gpu.to_arviz(num_samples=20).log_likelihood["obs"].shape == (1, 20, 150)


def test_a_learned_gp_on_cuda_matches_the_cpu():
    """Batched restarts with the Matérn kernel in closed form on CUDA reach the CPU's optimum
    (a linear function: one optimum, whichever device's generator draws the starts), and the
    predictive draws are made on CUDA when read."""
    from gpytorch.kernels import MaternKernel, ScaleKernel

    X, y = data(150, 2)
    fits = [
        aml.fit(aml.models.GaussianProcess(ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=2))), X.to(device), y.to(device), seed=0)
        for device in ("cpu", CUDA)
    ]
    assert fits[1].log_marginal_likelihood.item() == pytest.approx(fits[0].log_marginal_likelihood.item(), abs=1e-4)
    draws = fits[1].predict(X[:5].to(CUDA), num_samples=10).samples
    assert draws.device == X[:5].to(CUDA).device and draws.shape == (10, 5)


def test_svi_on_cuda_keeps_the_draws_on_cuda():
    X, y = data()
    X, y = X.to(CUDA), y.to(CUDA)

    def regression(X, y=None):
        beta = pyro.sample("beta", dist.Normal(X.new_zeros(3), 10.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Normal(X @ beta if beta.dim() == 1 else (beta @ X.T).squeeze(-2), 0.3), obs=y)

    post = aml.fit(regression, X, y, engine=SVI(num_steps=300, lr=0.05, progress_bar=False), seed=0)
    assert post.sample(10)["beta"].device.type == "cuda"
    torch.testing.assert_close(post.sample(2000)["beta"].mean(0).cpu(), torch.arange(1.0, 4.0, dtype=torch.float64), atol=0.1, rtol=0)
    assert post.predict(X[:4]).mean.device.type == "cuda"


@pytest.mark.parametrize("engine", [ChEES(num_chains=64, num_samples=200, warmup_steps=200),
                                    ChEES(num_chains=64, num_samples=200, warmup_steps=200, jit_compile="torch.compile"),
                                    NUTS(num_chains=16, num_samples=200, warmup_steps=200, vectorized=True, progress_bar=False)],
                         ids=["chees", "chees, torch.compile", "vectorised nuts"])
def test_many_chains_on_cuda_match_the_closed_form(engine):
    r"""Many chains in one batch on the GPU: draws on CUDA, the posterior mean within four
    Monte Carlo errors of the conjugate closed form (known noise 0.3, prior N(0, 10^2 I))."""
    X, y = data()

    def regression(X, y=None):
        beta = pyro.sample("beta", dist.Normal(X.new_zeros(3), 10.0).to_event(1))
        with pyro.plate("data", X.shape[0]):
            pyro.sample("obs", dist.Normal(X @ beta, 0.3), obs=y)

    precision = X.T @ X / 0.09 + torch.eye(3, dtype=X.dtype) / 100
    covariance = torch.linalg.inv(precision)
    mean = covariance @ (X.T @ y) / 0.09
    post = aml.fit(regression, X.to(CUDA), y.to(CUDA), engine=engine, seed=0)
    draws = post.samples["beta"]
    assert draws.device.type == "cuda"
    ess = torch.tensor(az.ess(post.to_arviz(), var_names=["beta"])["beta"].values)
    error = covariance.diagonal().sqrt() / ess.sqrt()
    assert ((draws.flatten(0, 1).mean(0).cpu() - mean).abs() < 4 * error).all()


def test_a_regression_networks_default_laplace_on_cuda_matches_the_cpu():
    r"""The default engine of a small regression BNN (the linearised Laplace) follows its data
    to CUDA: the same MAP start (seeded), a predictive on CUDA close to the CPU's."""
    X, y = data()
    network = aml.models.BayesianNeuralNetwork(3, hidden=(8,), activation="tanh")
    cpu = aml.fit(network, X.float(), y.float(), seed=0)
    gpu = aml.fit(network, X.float().to(CUDA), y.float().to(CUDA), seed=0)
    assert gpu.engine == "laplace" and gpu.predict(X[:5].float().to(CUDA), num_samples=200).mean.device.type == "cuda"
    torch.testing.assert_close(gpu.log_prob(X.float().to(CUDA), y.float().to(CUDA)).cpu(), cpu.log_prob(X.float(), y.float()), rtol=1e-3, atol=1e-3)


def test_bo_acquisitions_on_cuda():
    from aml_ppl.bo import ITL, UncertaintySampling

    X, y = data(40, 2)
    post = aml.fit(aml.models.GaussianProcess(), X.to(CUDA), y.to(CUDA), engine=Exact(learn=False))
    model = post.to_botorch()
    candidates = torch.rand(64, 1, 2, dtype=torch.float64, device=CUDA)
    for acquisition in (ITL([model], target=candidates[:16, 0]), UncertaintySampling([model])):
        values = acquisition(candidates)
        assert values.device.type == "cuda" and values.shape == (64,)


def test_ddpm_follows_its_data_to_cuda_and_its_bound_matches_the_cpu():
    torch.manual_seed(0)
    model = aml.models.DDPM((2,), num_timesteps=50, network_options={"hidden": 32})
    x0 = torch.randn(256, 2)
    post = aml.fit(model, x0.to(CUDA), engine=SVI(num_steps=50, progress_bar=False), seed=0)
    assert next(model.network.parameters()).device.type == "cuda"
    samples = post.predict(num_samples=64, seed=0, progress_bar=False).samples
    assert samples.device.type == "cuda" and samples.shape == (64, 2)
    noise = torch.randn(3, 256, 2)
    timesteps = torch.randint(1, 51, (3, 256))
    with torch.no_grad():
        gpu = model.timestep_terms(x0.to(CUDA), timesteps.to(CUDA), noise.to(CUDA)).cpu()
        model.to("cpu")
        cpu = model.timestep_terms(x0, timesteps, noise)
    torch.testing.assert_close(gpu, cpu, rtol=1e-4, atol=1e-4)


def test_the_quick_demo_trains_its_networks_on_the_gpu(tmp_path, capsys):
    from aml_ppl.cli import main

    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert f"trained on {torch.cuda.get_device_name(0)}" in printed
    (report,) = tmp_path.glob("run-*/report.html")
    assert f"networks (BNN, DDPM) on {torch.cuda.get_device_name(0)}" in report.read_text()
