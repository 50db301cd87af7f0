"""The doctor: checks that find the bug and the bottleneck before the long run.

One function per check, each returning a list of ``Finding`` (severity, measured, cause, fix).
``preflight`` runs the quick ones before ``ironloop train``; ``ironloop doctor`` runs them all,
``--lr-find`` adds the LR range test. ``diagnose_logs`` reads a finished run's logs.
"""

from ironloop.tools.doctor.findings import Finding

__all__ = ["Finding"]
