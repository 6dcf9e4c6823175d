r"""Where a warning points: the user's line, however deep in the package it was raised."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

PACKAGE = str(Path(__file__).resolve().parent.parent) + os.sep  # aml_ppl/, not aml_ppl_demo.py beside it


def user_stacklevel() -> int:
    r"""The ``stacklevel`` for a ``warnings.warn`` in the function that calls this one that names
    the first frame outside ``aml_ppl``: the user's call, whichever of the package's paths
    (``fit``, ``resume``, an engine called directly) led to the warning."""
    frame = inspect.currentframe()
    frame = frame.f_back if frame is not None else None  # the function that warns: level 1
    level = 1
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(PACKAGE):
        frame = frame.f_back
        level += 1
    return level
