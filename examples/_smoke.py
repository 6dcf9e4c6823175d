"""`--smoke` for every example: tiny budgets, so the test suite can run them all."""

import sys

SMOKE = "--smoke" in sys.argv


def budget(full: int, smoke: int) -> int:
    """``smoke`` with ``--smoke`` on the command line, else ``full``."""
    return smoke if SMOKE else full
