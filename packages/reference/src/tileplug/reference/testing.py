"""The testing helpers, re-exported from :mod:`tileplug.core.testing` (where they live, so
that a backend's tests need no reference installed)."""

from tileplug.core.testing import *  # noqa: F401,F403
from tileplug.core.testing import __all__  # noqa: F401
