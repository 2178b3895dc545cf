"""``python -m xtl`` is the ``xtl`` command."""

import sys

from xtl.cli import main

sys.exit(main())
