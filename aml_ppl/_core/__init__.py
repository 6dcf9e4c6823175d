r"""The bottom floor: what every other module may use; imports only torch, Pyro and numpy.

- :mod:`~aml_ppl._core.randomness`: local random streams (nothing reseeds the caller's).
- :mod:`~aml_ppl._core.checks`: the declared argument constraints that constructors use.
"""
