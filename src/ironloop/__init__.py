"""ironloop: a production PyTorch training loop you can read in one sitting."""

__version__ = "0.1.0"
