"""``python -m ironloop``: what torchrun launches, and the ``ironloop`` command."""

from ironloop.cli import entry

entry()
