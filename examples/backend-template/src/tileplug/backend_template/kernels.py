"""The template backend's kernels: each one delegates to the reference kernel of its op.

A kernel is any object with two methods (the ``tileplug.core.Kernel`` protocol):

- ``supports(call) -> str | None``: None to accept the call, else a short reason. The
  registry asks once per call *signature* and caches the answer, so decide only from the
  call's compared fields (everything in the QuantCall but ``tokens`` and ``device``).
  ``call.op`` is the kernel-table key (``per_token_cast`` also for its variants),
  ``call.name`` the public op, ``call.mode`` a ``tileplug.core.QuantMode`` (compare with
  ``QuantMode.CAST`` etc., never with strings).
  A declined call falls through to the next backend serving the device (in the end the
  reference), and the reason shows in ``core.registry.explain`` and ``NoBackendError``.
- ``__call__(call, inputs, outputs)``: write ``outputs`` in place, return nothing. It is
  never called with zero tokens; outputs are already allocated in the layout of the
  backend's traits.

VENDOR: replace ``DelegatingToReferenceKernel`` with your kernels (typically one module
per op, each a JIT factory specialised on the call's compile-time constants), and the
``supports`` rules with what your kernels really cannot do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tileplug.core import Call

# VENDOR: these imports go away with the delegation; a real backend imports its own kernels.
from tileplug.reference.moe import gate as reference_gate
from tileplug.reference.moe import permute as reference_permute
from tileplug.reference.norm.layer_norm import layer_norm as reference_layer_norm
from tileplug.reference.norm.layer_norm_backward import layer_norm_backward as reference_layer_norm_backward
from tileplug.reference.norm.rms_norm import rms_norm as reference_rms_norm
from tileplug.reference.norm.rms_norm_backward import rms_norm_backward as reference_rms_norm_backward
from tileplug.reference.norm.rms_norm_per_token_cast import (
    rms_norm_per_token_cast as reference_rms_norm_per_token_cast,
)
from tileplug.reference.quant.cast_back import cast_back as reference_cast_back
from tileplug.reference.quant.nearest_cast import nearest_cast as reference_nearest_cast
from tileplug.reference.random import draw as reference_random
from tileplug.reference.quant.per_block_cast import per_block_cast as reference_per_block_cast
from tileplug.reference.quant.per_block_cast_lossless import per_block_cast_lossless as reference_lossless
from tileplug.reference.quant.per_channel_cast import per_channel_cast as reference_per_channel_cast
from tileplug.reference.quant.per_token_cast import per_token_cast as reference_per_token_cast
from tileplug.reference.quant.stochastic_cast import stochastic_cast as reference_stochastic_cast
from tileplug.reference.quant.transpose_weight_sf import transpose_weight_sf as reference_transpose_weight_sf
from tileplug.reference.quant.per_token_cast_and_cast_back import (
    per_token_cast_and_cast_back as reference_per_token_cast_and_cast_back,
)
from tileplug.reference.rope.apply_rotary import apply_rotary as reference_apply_rotary
from tileplug.reference.rope.rms_norm_rope import rms_norm_rope as reference_rms_norm_rope
from tileplug.reference.swiglu.swiglu import swiglu as reference_swiglu
from tileplug.reference.swiglu.swiglu_backward import swiglu_backward as reference_swiglu_backward
from tileplug.reference.swiglu.swiglu_per_token_cast import swiglu_per_token_cast as reference_swiglu_per_token_cast

DECLINED_FORMATS: set[str] = {"e2m1"}
"""Formats the template declines, to demonstrate a kernel declining. VENDOR: empty it
(``DECLINED_FORMATS: set[str] = set()``) or replace the rule in ``supports``; a declined
call fails the conformance suite, which holds a backend to every case."""

E2M1_REASON = "fmt 'e2m1' is not implemented by the template backend (it declines, the next backend runs it)"
"""Why the template declines e2m1 calls."""


def _formats_in(call: Call) -> set[str]:
    """Names of the quantized formats a call reads or writes."""
    names = set()
    quant = getattr(call, "quant", None)  # a norm call that ends in a per-token cast (NormCall)
    if quant is not None:
        return _formats_in(quant)
    if getattr(call, "cast", None) is not None:  # the output of a cast (None for cast_back)
        names.add(call.cast.fmt.name)
    if getattr(call, "quantized_input", None) is not None:  # an (xq, sf) input: re-quantization or cast_back
        names.add(call.quantized_input.fmt.name)
    return names


@dataclass(frozen=True)
class DelegatingToReferenceKernel:
    """A kernel that does no work of its own: it runs the reference kernel of ``op``.

    It only exists so that this template is a complete, installable, working backend.
    VENDOR: replace it with a real kernel.
    """

    op: str
    run: Callable[[Call, Any, Any], None]

    def supports(self, call: Call) -> str | None:
        # Decline what the kernel cannot do, with a reason a user can act on. Read only
        # compared fields (op, mode, device_type, hidden, input_dtype, cast,
        # quantized_input, given_sf, output_dtype); never call.tokens or call.device,
        # never the tensors' values: the answer is cached per call signature.
        #
        # Typical rules of a real backend (VENDOR: replace the one below with yours):
        #   if call.hidden % 16:                   return "hidden size must be a multiple of 16"
        #   if call.input_dtype != torch.bfloat16: return "only bf16 input"
        #   if call.mode is QuantMode.PRECOMPUTED_SF: return "cast with given sf not implemented"
        #   if call.quantized_input is not None:   return "re-quantization not implemented"
        #   if call.cast is not None and call.cast.block[0] > 64: return "block rows > 64 not implemented"
        # (call.cast is None for cast_back; call.quantized_input is None for a bf16/fp32 x.)
        # Strides are not in the call: inputs.x may have any row stride, handle it.
        if _formats_in(call) & DECLINED_FORMATS:
            return E2M1_REASON
        return None

    def __call__(self, call: Call, inputs: Any, outputs: Any) -> None:
        # inputs.x is [T, H] (T > 0 here); outputs.q / outputs.sf are preallocated in the
        # layout this backend's traits fix. Write them in place; do not reallocate, do not
        # return anything, do not synchronize with the host.
        self.run(call, inputs, outputs)


KERNELS: dict[str, DelegatingToReferenceKernel] = {
    "per_token_cast": DelegatingToReferenceKernel("per_token_cast", reference_per_token_cast),
    "per_block_cast": DelegatingToReferenceKernel("per_block_cast", reference_per_block_cast),
    "per_channel_cast": DelegatingToReferenceKernel("per_channel_cast", reference_per_channel_cast),
    "cast_back": DelegatingToReferenceKernel("cast_back", reference_cast_back),
    # e2m1 → e4m3 re-blocking (declined: it reads e2m1) and the DeepGEMM weight-scale layout
    # (inputs: the weights' scale tensors; outputs: (sf0, sf1) of each, flat)
    "per_block_cast_lossless": DelegatingToReferenceKernel("per_block_cast_lossless", reference_lossless),
    "transpose_weight_sf": DelegatingToReferenceKernel("transpose_weight_sf", reference_transpose_weight_sf),
    "stochastic_cast": DelegatingToReferenceKernel("stochastic_cast", reference_stochastic_cast),
    "nearest_cast": DelegatingToReferenceKernel("nearest_cast", reference_nearest_cast),
    # in place: writes inputs.x (fake quant; its outputs are empty)
    "per_token_cast_and_cast_back": DelegatingToReferenceKernel("per_token_cast_and_cast_back",
                                                                reference_per_token_cast_and_cast_back),
    "rms_norm": DelegatingToReferenceKernel("rms_norm", reference_rms_norm),
    "layer_norm": DelegatingToReferenceKernel("layer_norm", reference_layer_norm),
    "rms_norm_per_token_cast": DelegatingToReferenceKernel("rms_norm_per_token_cast", reference_rms_norm_per_token_cast),
    "rms_norm_backward": DelegatingToReferenceKernel("rms_norm_backward", reference_rms_norm_backward),
    "layer_norm_backward": DelegatingToReferenceKernel("layer_norm_backward", reference_layer_norm_backward),
    # in place: writes inputs.query / inputs.key (its outputs are empty)
    "apply_rotary": DelegatingToReferenceKernel("apply_rotary", reference_apply_rotary),
    "rms_norm_rope": DelegatingToReferenceKernel("rms_norm_rope", reference_rms_norm_rope),
    # MoE routing: indices, weights, counts and the expanded layout
    "topk_gate": DelegatingToReferenceKernel("topk_gate", reference_gate.topk_gate),
    "normalize_weight": DelegatingToReferenceKernel("normalize_weight", reference_gate.normalize_weight),
    "moe_topk_gate": DelegatingToReferenceKernel("moe_topk_gate", reference_gate.moe_topk_gate),
    "moe_topk_gate_backward": DelegatingToReferenceKernel("moe_topk_gate_backward",
                                                          reference_gate.moe_topk_gate_backward),
    "moe_expert_counts": DelegatingToReferenceKernel("moe_expert_counts", reference_permute.moe_expert_counts),
    "moe_permute": DelegatingToReferenceKernel("moe_permute", reference_permute.moe_permute),
    "moe_unpermute": DelegatingToReferenceKernel("moe_unpermute", reference_permute.moe_unpermute),
    # SwiGLU: the activation, its fused per-token cast (declined for e2m1 like the casts) and its backward
    "swiglu": DelegatingToReferenceKernel("swiglu", reference_swiglu),
    "swiglu_per_token_cast": DelegatingToReferenceKernel("swiglu_per_token_cast", reference_swiglu_per_token_cast),
    "swiglu_backward": DelegatingToReferenceKernel("swiglu_backward", reference_swiglu_backward),
    # random numbers, in place: write inputs.values and advance inputs.offset (the generator's state)
    "fill_rand": DelegatingToReferenceKernel("fill_rand", reference_random.fill_rand),
    "fill_randn": DelegatingToReferenceKernel("fill_randn", reference_random.fill_randn),
}
"""Kernel-table key (``opdef.kernel``) → kernel. One kernel serves an op and its variants
(``call.mode``: ``QuantMode.CAST``, ``SF_ONLY``, ``PRECOMPUTED_SF``; e.g. the
``per_token_cast`` kernel serves ``per_token_cast_with_sf_only`` too). A key left out
here falls through to the next backend."""
