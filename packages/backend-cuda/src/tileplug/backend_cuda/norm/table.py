"""The kernel objects of the CUDA norm ops (the protocol side: ``supports`` / ``spec`` /
``prepare`` and each kernel's argument order), one per op; each op's TileLang kernel is
built by its module, ``tileplug.backend_cuda.norm.<op>`` (``NormKernelSpec.build``).

Nothing here imports TileLang: a process that finds its kernels in the kernel index loads
them without TileLang's import (``jit``), so the CUDA plugin must import without it too.
The argument orders below are the signatures of the ``build`` functions of those modules.
"""

from __future__ import annotations

from tileplug.backend_cuda.norm.backward import BackwardKernel
from tileplug.backend_cuda.norm.kernels import NormKernel
from tileplug.backend_cuda.norm.spec import NormKernelSpec, QuantSpec, make_spec
from tileplug.core.contracts.norm import NormBackwardInputs, NormCall, NormGradients, NormInputs, NormOutputs
from tileplug.core.quant.layouts import CUDA_LAYOUT


class RmsNorm(NormKernel):
    """The ``rms_norm`` kernel object (``supports`` / ``prepare`` / ``__call__``)."""

    op = "rms_norm"

    def arguments(self, call: NormCall):
        """(inputs, outputs) → the kernel's tensors, in its signature's order."""
        residual = call.residual
        stats = call.stats
        weighted = call.weight_dtype is not None

        def order(inputs: NormInputs, outputs: NormOutputs) -> tuple:
            x = inputs.x
            return (x, inputs.weight if weighted else x, inputs.residual if residual else x, outputs.y,
                    outputs.residual_out if residual else x, outputs.rstd if stats else x)

        return order


class LayerNorm(NormKernel):
    """The ``layer_norm`` kernel object (``supports`` / ``prepare`` / ``__call__``)."""

    op = "layer_norm"

    def arguments(self, call: NormCall):
        residual = call.residual
        stats = call.stats
        weighted = call.weight_dtype is not None
        biased = call.bias_dtype is not None

        def order(inputs: NormInputs, outputs: NormOutputs) -> tuple:
            x = inputs.x
            return (x, inputs.weight if weighted else x, inputs.bias if biased else x,
                    inputs.residual if residual else x, outputs.y, outputs.residual_out if residual else x,
                    outputs.mean if stats else x, outputs.rstd if stats else x)

        return order


class RmsNormPerTokenCast(NormKernel):
    """The ``rms_norm_per_token_cast`` kernel object."""

    op = "rms_norm_per_token_cast"

    def reason(self, call: NormCall) -> str | None:
        group = call.quant.cast.block[1]
        if call.heads is not None and call.hidden % group:
            return (f"3-D input with D = {call.hidden} not a multiple of the group {group}: a group would straddle "
                    "two heads' rows")
        return None

    def spec(self, call: NormCall) -> NormKernelSpec:
        cast = call.quant.cast
        quant = QuantSpec(
            fmt=cast.fmt.name,
            group=cast.block[1],
            sf_kind=cast.sf_encoding(CUDA_LAYOUT).kind,
            sf_col_major=bool(cast.col_major_sf) and cast.sf_encoding(CUDA_LAYOUT).kind == "ue8m0",
            round_sf=bool(cast.round_sf),
            clamp_min=float(cast.clamp_min),
            unquantized=call.unquantized,
        )
        return make_spec(call, quant)

    def arguments(self, call: NormCall):
        residual = call.residual
        weighted = call.weight_dtype is not None
        unquantized = call.unquantized

        def order(inputs: NormInputs, outputs: NormOutputs) -> tuple:
            x = inputs.x
            return (x, inputs.weight if weighted else x, inputs.residual if residual else x,
                    outputs.residual_out if residual else x, outputs.y if unquantized else x, outputs.q,
                    outputs.sf)

        return order


class RmsNormBackward(BackwardKernel):
    """The ``rms_norm_backward`` kernel object: the row kernel, then the column sum of its
    weight-gradient partials (``backward.BackwardKernel``)."""

    op = "rms_norm_backward"

    def reduced(self, call: NormCall) -> tuple[str, ...]:
        return ("grad_weight",) if call.weight_dtype is not None else ()

    def arguments(self, call: NormCall):
        weighted = call.weight_dtype is not None
        grad_residual = call.grad_residual

        def order(inputs: NormBackwardInputs, outputs: NormGradients, partials: tuple) -> tuple:
            x = inputs.x
            return (inputs.grad_y, x, inputs.weight if weighted else x, inputs.rstd,
                    inputs.grad_residual_out if grad_residual else x, outputs.grad_x,
                    partials[0] if weighted else x)

        return order


class LayerNormBackward(BackwardKernel):
    """The ``layer_norm_backward`` kernel object: the row kernel, then the column sums of its
    weight- and bias-gradient partials (``backward.BackwardKernel``)."""

    op = "layer_norm_backward"

    def reduced(self, call: NormCall) -> tuple[str, ...]:
        return ("grad_bias", "grad_weight") if call.weight_dtype is not None else ("grad_bias",)

    def arguments(self, call: NormCall):
        weighted = call.weight_dtype is not None
        grad_residual = call.grad_residual

        def order(inputs: NormBackwardInputs, outputs: NormGradients, partials: tuple) -> tuple:
            x = inputs.x
            return (inputs.grad_y, x, inputs.weight if weighted else x, inputs.mean, inputs.rstd,
                    inputs.grad_residual_out if grad_residual else x, outputs.grad_x,
                    partials[1] if weighted else x, partials[0])

        return order
