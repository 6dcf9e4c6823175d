r"""What the posterior's verbs read of a posterior, each declared once as a ``typing.Protocol``.

:class:`~aml_ppl.inference.base.Posterior` keeps the record and checks its arguments; its
verbs are computed by functions over it: the predictive and the replay in
:mod:`~aml_ppl.inference.predictive`, the ArviZ converter in :mod:`~aml_ppl.inference.export`,
saving and loading in :mod:`~aml_ppl.inference.io`. Those functions take the protocols here
rather than the class, so that the modules sit below the class whose methods delegate to them
(as BoTorch's acquisition functions take any ``Model`` with a ``posterior``). Every posterior
kind satisfies all of them; ``tests/contract`` checks each engine's.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

import torch

from aml_ppl._core.randomness import RandomStream
from aml_ppl._core.records import Prediction
from aml_ppl.inference.fitted import Fitted
from aml_ppl.inference.replay import Replayed
from aml_ppl.inference.structure import Structure


@runtime_checkable
class PosteriorRecord(Protocol):
    r"""What a fit produced (:class:`~aml_ppl.inference.base.Posterior`'s attributes): the
    :class:`~aml_ppl.inference.fitted.Fitted` record and its fields, the model's sites by kind,
    and whether it is a point mass."""

    fitted: Fitted
    model: Callable
    data_args: tuple
    data_kwargs: dict
    engine: str
    objective: str
    history: torch.Tensor
    param_sites: dict[str, torch.Tensor]

    @property
    def structure(self) -> Structure: ...

    @property
    def is_point_estimate(self) -> bool: ...


@runtime_checkable
class Replayable(PosteriorRecord, Protocol):
    r"""A posterior whose draws the model can be replayed under (what
    :mod:`~aml_ppl.inference.predictive` reads): its draws, where they meet new arguments, the
    replay itself and the hooks of a closed form."""

    def model_draws(self, num_samples: int = 1000) -> dict[str, torch.Tensor]: ...

    def draws_at(self, num_draws: int, args: tuple, kwargs: dict, draws: dict | None = None) -> dict[str, torch.Tensor]: ...

    def replay(
        self, num_draws: int, args: tuple, kwargs: dict, draws: dict | None = None, keep: tuple[str, str] | None = None, without: tuple[str, ...] = ()
    ) -> Replayed: ...

    def fit_statistics(self) -> dict[str, torch.Tensor] | None: ...

    def predictive_replicates(self, site: str, num_draws: int, args: tuple, kwargs: dict, draws: dict) -> torch.Tensor: ...


@runtime_checkable
class Exportable(Replayable, Protocol):
    r"""A posterior the ArviZ converter (:func:`~aml_ppl.inference.export.describe`) writes: a
    replayable one with the export's hooks (draws by chain, their reported units, the
    ``sample_stats``, a point estimate's Gaussian approximation) and the verbs a model known
    through its bound exports."""

    def local_approximation(self, num_samples: int) -> Exportable | None: ...

    def draws_by_chain(self, num_samples: int) -> dict[str, torch.Tensor]: ...

    def reported_draws(self, draws: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def sample_stats(self, draws: dict[str, torch.Tensor], lp: torch.Tensor | None = None) -> dict[str, Any]: ...

    def predict(self, *args: Any, num_samples: int = 1000, site: str | None = None, **kwargs: Any) -> Prediction: ...

    def log_prob(self, *args: Any, num_samples: int = 1000, site: str | None = None, **kwargs: Any) -> torch.Tensor: ...


@runtime_checkable
class Savable(PosteriorRecord, Protocol):
    r"""A posterior that :func:`~aml_ppl.inference.io.save` writes and
    :func:`~aml_ppl.inference.io.load` rebuilds: its kind's registered name, its random stream,
    and its state as tensors and JSON-compatible metadata."""

    kind: ClassVar[str]
    random_stream: RandomStream

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]: ...

    @classmethod
    def from_state(cls, fitted: Fitted, tensors: dict[str, torch.Tensor], meta: dict[str, Any], guide: Callable | None) -> Savable: ...
