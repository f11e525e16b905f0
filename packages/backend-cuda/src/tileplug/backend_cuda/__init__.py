"""tileplug.backend_cuda: TileLang kernels for NVIDIA GPUs of compute capability 9.0 and newer."""

__version__ = "0.1.0"
