"""tileplug.core: op contracts, backend discovery and dispatch. No kernels live here.

    from tileplug import core
    q, sf = core.ops.per_token_cast(x)     # runs on the backend installed for x.device
"""

from tileplug.core import config, ops
from tileplug.core.backend import ANY_DEVICE, QUANT_OPS, Backend, Kernel
from tileplug.core.contracts.quant import Ledger, QuantCall, QuantInputs, QuantOutputs
from tileplug.core.errors import BackendError, ContractError, NoBackendError, TileplugError
from tileplug.core.lowering import LoweringError, describe_call, lower
from tileplug.core.plugins import hookimpl
from tileplug.core.quant.configs import CastConfig
from tileplug.core.quant.layouts import ASCEND_LAYOUT, CUDA_LAYOUT, LayoutTraits
from tileplug.core.registry import registry, use_backend

__version__ = "0.1.0"

__all__ = [
    "ANY_DEVICE",
    "ASCEND_LAYOUT",
    "Backend",
    "BackendError",
    "CUDA_LAYOUT",
    "CastConfig",
    "ContractError",
    "Kernel",
    "Ledger",
    "LayoutTraits",
    "LoweringError",
    "NoBackendError",
    "QUANT_OPS",
    "QuantCall",
    "QuantInputs",
    "QuantOutputs",
    "TileplugError",
    "config",
    "describe_call",
    "hookimpl",
    "lower",
    "ops",
    "registry",
    "use_backend",
]
