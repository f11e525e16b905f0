"""tileplug.backend_ascend: TileLang Ascend-dialect kernels for Ascend 950 (torch_npu devices)."""

__version__ = "0.1.0"
