"""Reference kernels of the SwiGLU family (SPEC §8): plain PyTorch, exact to the contract, on any device."""
