r"""An HMM as Pyro's ``examples/hmm.py`` writes its first batched model (issue 28, item 3):
the observations of a sequence are tied by the enumerated chain of hidden states, so the
unit of the log-likelihood (and of LOO) is the sequence, its marginal the forward algorithm's,
checked against a brute-force sum over every path of hidden states."""

import itertools
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine

import aml_ppl as aml
from aml_ppl.errors import InputDataError
from aml_ppl.inference import SVI, predictive


# The module-scoped fits are made once: all of its tests in one xdist process (`--dist loadgroup`).
pytestmark = pytest.mark.xdist_group("hmm")

HIDDEN = 2


def hmm(sequences, lengths, batch_size=None):
    r"""``model_1`` of Pyro's ``examples/hmm.py``: its priors (sticky Dirichlet transitions,
    Beta(0.1, 0.9) tones), ``sequences`` at ``dim=-2`` (``batch_size`` of them at a time)
    around ``tones`` at ``dim=-1``, steps past a sequence's length masked out, the hidden state
    enumerated under ``pyro.markov``."""
    num_sequences, max_length, data_dim = sequences.shape
    probs_x = pyro.sample("probs_x", dist.Dirichlet(0.9 * torch.eye(HIDDEN) + 0.1).to_event(1))
    probs_y = pyro.sample("probs_y", dist.Beta(0.1, 0.9).expand([HIDDEN, data_dim]).to_event(2))
    tones = pyro.plate("tones", data_dim, dim=-1)
    with pyro.plate("sequences", num_sequences, batch_size, dim=-2) as batch:
        x = 0
        for t in pyro.markov(range(max_length)):
            with poutine.mask(mask=(t < lengths[batch]).unsqueeze(-1)):
                x = pyro.sample(f"x_{t}", dist.Categorical(probs_x[x]), infer={"enumerate": "parallel"})
                with tones:
                    pyro.sample(f"y_{t}", dist.Bernoulli(probs_y[x.squeeze(-1)]), obs=sequences[batch, t])


def by_paths(probs_x: torch.Tensor, probs_y: torch.Tensor, sequence: torch.Tensor) -> float:
    r""":math:`\log \sum_{x_{0:T}} \prod_t p(x_t \mid x_{t-1})\, p(y_t \mid x_t)`, every path
    of hidden states written out (``x_{-1} = 0``, as the model starts)."""
    terms = []
    for path in itertools.product(range(HIDDEN), repeat=len(sequence)):
        total, previous = 0.0, 0
        for step, state in enumerate(path):
            total += math.log(probs_x[previous, state]) + dist.Bernoulli(probs_y[state]).log_prob(sequence[step]).sum().item()
            previous = state
        terms.append(total)
    return torch.logsumexp(torch.tensor(terms, dtype=torch.float64), 0).item()


@pytest.fixture(scope="module")
def fitted():
    generator = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, 2, (3, 4, 2), generator=generator).float()
    lengths = torch.tensor([4, 2, 3])  # the second and third padded past their ends
    post = aml.fit(hmm, sequences, lengths, engine=SVI(num_steps=50, progress_bar=False), seed=0)
    return post, sequences, lengths


def test_each_sequences_log_likelihood_is_the_sum_over_its_hidden_paths(fitted):
    post, sequences, lengths = fitted
    idata = post.to_arviz(num_samples=4)
    (name,) = idata.log_likelihood.data_vars
    assert name == "y_0..y_3" and idata.log_likelihood[name].dims == ("chain", "draw", "sequences")
    probs_x = torch.as_tensor(idata.posterior["probs_x"].values)[0].double()
    probs_y = torch.as_tensor(idata.posterior["probs_y"].values)[0].double()
    for draw in range(4):
        expected = [by_paths(probs_x[draw], probs_y[draw], sequences[i, : lengths[i]]) for i in range(3)]
        # float32 model: a few ulps of terms near -5
        torch.testing.assert_close(torch.as_tensor(idata.log_likelihood[name].values[0, draw]).double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-5)
    # lp: the priors plus the three sequences' marginals (a padded step adds nothing, not log K)
    prior = dist.Dirichlet(0.9 * torch.eye(HIDDEN) + 0.1).log_prob(probs_x).sum(-1) + dist.Beta(0.1, 0.9).log_prob(probs_y).sum((-1, -2))
    joint = prior + torch.as_tensor(idata.log_likelihood[name].values[0]).double().sum(-1)
    torch.testing.assert_close(torch.as_tensor(idata.sample_stats["lp"].values[0]).double(), joint, rtol=1e-6, atol=1e-4)


def test_log_prob_returns_the_sequence_terms_and_refuses_one_step(fitted):
    post, sequences, lengths = fitted
    pyro.set_rng_seed(1)
    draws = post.sample(20)  # past tracing.per_draw's compile_from: the runs after the first are compiled
    per_draw = torch.stack([
        torch.tensor([by_paths(draws["probs_x"][s].double(), draws["probs_y"][s].double(), sequences[i, : lengths[i]]) for i in range(3)], dtype=torch.float64)
        for s in range(20)
    ])
    mean = predictive.log_mean_likelihood(post, draws, "y_0..y_3", (sequences, lengths), {})
    torch.testing.assert_close(mean.double(), torch.logsumexp(per_draw, 0) - math.log(20), rtol=0, atol=1e-5)
    assert post.log_prob(num_samples=10).shape == (3,)  # the one term there is, by default
    with pytest.raises(InputDataError, match="'y_1' is tied .* site='y_0..y_3'"):
        post.log_prob(site="y_1")


def test_a_subsampled_sequences_plate_gives_every_sequence_its_term(fitted):
    r"""``hmm.py`` subsamples its sequences (``batch_size``): the replay covers them a batch at a
    time and puts each sequence's joint term in its place, as the model without subsampling."""
    post, sequences, lengths = fitted
    draws = post.sample(3)
    whole = predictive.log_mean_likelihood(post, draws, "y_0..y_3", (sequences, lengths), {})
    batched = aml.fit(hmm, sequences, lengths, batch_size=2, engine=SVI(num_steps=5, progress_bar=False), seed=0)
    pieces = predictive.log_mean_likelihood(batched, draws, "y_0..y_3", (sequences, lengths), {"batch_size": 2})
    torch.testing.assert_close(pieces, whole, rtol=0, atol=1e-6)
