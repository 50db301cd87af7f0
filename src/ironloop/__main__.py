"""``python -m ironloop``: what torchrun launches."""

import sys

from ironloop.cli import main

sys.exit(main())
