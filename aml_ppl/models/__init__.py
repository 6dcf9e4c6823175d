r"""What we believe generated the data: Pyro generative models with guides."""

from aml_ppl.models import protocols
from aml_ppl.models.base import GaussianLatents, Model, register_model
from aml_ppl.models.bnn import BayesianNeuralNetwork
from aml_ppl.models.ddpm import DDPM, DiffusionELBO, MLPDenoiser, NoiseSchedule, UNetDenoiser
from aml_ppl.models.gp import GaussianProcess, SparseGaussianProcess
from aml_ppl.models.kernels import SigmoidKernel
from aml_ppl.models.linear import BayesianLinearRegression
from aml_ppl.models.logistic import BayesianLogisticRegression
from aml_ppl.models.mixture import CollapsedComponentWarning, GaussianMixture

__all__ = [
    "BayesianLinearRegression",
    "BayesianLogisticRegression",
    "BayesianNeuralNetwork",
    "CollapsedComponentWarning",
    "DDPM",
    "DiffusionELBO",
    "GaussianLatents",
    "GaussianMixture",
    "GaussianProcess",
    "MLPDenoiser",
    "Model",
    "NoiseSchedule",
    "protocols",
    "register_model",
    "SigmoidKernel",
    "SparseGaussianProcess",
    "UNetDenoiser",
]
