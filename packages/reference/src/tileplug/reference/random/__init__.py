"""Reference kernels of the random numbers (SPEC §9): Philox4x32-10 on int64 tensors and the
uniform / normal transforms of its words, on any device."""
