"""``python -m tests.upstream``: see :mod:`tests.upstream.run`."""

import sys

from .run import main

sys.exit(main())
