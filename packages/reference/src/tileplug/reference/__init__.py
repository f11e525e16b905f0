"""tileplug.reference: the exact PyTorch model of SPEC.md, a backend for every device type.

Also ships :mod:`tileplug.reference.testing` (bytewise compare, relative error, shape
generators that favour non-aligned sizes).
"""

__version__ = "0.1.0"
