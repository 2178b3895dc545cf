"""``python -m xtl`` is the ``xtl`` command."""

import sys

from xtl.command import main

sys.exit(main())
