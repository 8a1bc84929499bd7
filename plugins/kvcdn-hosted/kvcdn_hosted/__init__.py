"""kvcdn-hosted: the client of a kvcdn hosted endpoint (``kvcdn serve``).

Importing this package is cheap (click only); httpx and the artifact reader load when a command runs.
"""

__version__ = "0.1.0"
