"""``python -m gpucheck`` (from tests/gpu): see :mod:`gpucheck.cli`."""

import sys

from .cli import main

sys.exit(main())
