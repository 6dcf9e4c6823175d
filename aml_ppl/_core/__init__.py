r"""The bottom floor: what every other module may use; imports only torch, Pyro, numpy and
:mod:`aml_ppl.errors` (``tests/test_architecture.py`` holds it to that).

- :mod:`~aml_ppl._core.randomness`: local random streams (nothing reseeds the caller's).
- :mod:`~aml_ppl._core.checks`: the declared argument constraints that constructors use.
- :mod:`~aml_ppl._core.registry`: name-to-class registries that refuse a taken name.
- :mod:`~aml_ppl._core.records`: typed records shared across floors (``Prediction``).
- :mod:`~aml_ppl._core.linalg`: a shifted diagonal, triangular solves, a Cholesky with advice.
- :mod:`~aml_ppl._core.files`: files written whole or not at all.
- :mod:`~aml_ppl._core.version`: the package's version.
"""
