"""tileplug.core: op contracts, backend discovery and dispatch. No kernels live here.

    from tileplug import core
    q, sf = core.ops.per_token_cast(x)     # runs on the backend installed for x.device
"""

from tileplug.core import config, nn, opdefs, ops, random
from tileplug.core.backend import ANY_DEVICE, Backend, DeferredKernel, Kernel, deferred_kernel_table
from tileplug.core.call import Call, Ledger, QuantMode, Scoring
from tileplug.core.contracts.quant import QuantCall, QuantInputs, QuantOutputs
from tileplug.core.errors import BackendError, ContractError, NoBackendError, TileplugError
from tileplug.core.lowering import LoweringError, lower
from tileplug.core.opdefs import BenchCase, Case, OpDef, declare, describe_call
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
    "BenchCase",
    "Call",
    "Case",
    "DeferredKernel",
    "CUDA_LAYOUT",
    "CastConfig",
    "ContractError",
    "Kernel",
    "Ledger",
    "LayoutTraits",
    "LoweringError",
    "NoBackendError",
    "OpDef",
    "QuantCall",
    "QuantInputs",
    "QuantMode",
    "QuantOutputs",
    "Scoring",
    "TileplugError",
    "config",
    "declare",
    "deferred_kernel_table",
    "describe_call",
    "hookimpl",
    "lower",
    "nn",
    "opdefs",
    "ops",
    "random",
    "registry",
    "use_backend",
]
