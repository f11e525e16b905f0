"""tileplug.reference: the exact PyTorch model of SPEC.md, a backend for every device type.

Also ships the conformance suite (:mod:`tileplug.reference.conformance`); the testing
helpers live in :mod:`tileplug.core.testing` (``tileplug.reference.testing`` re-exports them).
"""

__version__ = "0.1.0"
