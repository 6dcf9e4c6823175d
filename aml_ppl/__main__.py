r"""``python -m aml_ppl``: the ``aml-ppl`` command."""

import sys

from aml_ppl.cli import main

sys.exit(main())
