"""Reference norm kernels: SPEC §5 in PyTorch over :mod:`tileplug.core.norm.formulas`."""
