"""Reference kernels of the RoPE family (SPEC §6): exact PyTorch, fp32 math, one rounding at the store."""
