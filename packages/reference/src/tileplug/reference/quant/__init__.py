"""Reference kernels of the quantization family."""
