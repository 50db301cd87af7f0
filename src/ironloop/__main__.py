"""``python -m ironloop``: what torchrun launches, and the ``ironloop`` command."""

from ironloop.cli import entry

if __name__ == "__main__":  # imported, as the docs build's inspection does, it runs nothing
    entry()
