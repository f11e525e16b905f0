"""Reference kernels of the MoE routing family (SPEC §7): plain PyTorch over
:mod:`tileplug.core.moe.formulas`, exact to the contract, on any device."""
