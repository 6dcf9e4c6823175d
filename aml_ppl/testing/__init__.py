r"""Checks shipped for your own models and engines: capabilities by behaviour, the posterior
surface's contract by its cases.

- :mod:`~aml_ppl.testing.capabilities`: :func:`check_exact_gaussian` and
  :func:`check_closed_form_em` check what a model's declared capability *does* against its own
  Pyro program (``isinstance`` on a protocol reads method names only).
- :mod:`~aml_ppl.testing.contract`: :func:`check_engine` runs an engine of your own (or a
  configured built-in one) on a closed-form model and on every case of :data:`CASES` it can
  run, checking each posterior with :func:`check_posterior` (ArviZ export, predictions,
  ``log_prob``, save and load) against the case's plain-torch oracle;
  :func:`posterior_from_draws` is a posterior holding the draws you give it.
- :mod:`~aml_ppl.testing.cases`: the cases (:class:`Case`), from a conjugate normal with a
  ``pyro.factor`` to a built-in GP, BNN and Gaussian mixture, enumerated and subsampled sites
  and ``pyro.param`` sites.

Each check raises :class:`ContractError` naming the case or capability and what was wrong.
"""

from aml_ppl.errors import ContractError
from aml_ppl.testing.capabilities import check_closed_form_em, check_exact_gaussian
from aml_ppl.testing.cases import CASES, Case
from aml_ppl.testing.contract import (
    check_engine,
    check_export,
    check_posterior,
    check_predictions,
    check_round_trip,
    posterior_from_draws,
)

__all__ = [
    "CASES",
    "Case",
    "ContractError",
    "check_closed_form_em",
    "check_engine",
    "check_exact_gaussian",
    "check_export",
    "check_posterior",
    "check_predictions",
    "check_round_trip",
    "posterior_from_draws",
]
