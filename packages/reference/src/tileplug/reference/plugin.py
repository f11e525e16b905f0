"""Entry point of tileplug-reference: one backend serving every device type, lowest priority."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tileplug.core import ANY_DEVICE, ASCEND_LAYOUT, CUDA_LAYOUT, Backend, LayoutTraits, config, hookimpl
from tileplug.reference.moe import gate as moe_gate
from tileplug.reference.moe import permute as moe_permute
from tileplug.reference.norm.layer_norm import layer_norm
from tileplug.reference.norm.layer_norm_backward import layer_norm_backward
from tileplug.reference.norm.rms_norm import rms_norm
from tileplug.reference.norm.rms_norm_backward import rms_norm_backward
from tileplug.reference.norm.rms_norm_per_token_cast import rms_norm_per_token_cast
from tileplug.reference.quant.cast_back import cast_back
from tileplug.reference.quant.nearest_cast import nearest_cast
from tileplug.reference.quant.per_block_cast import per_block_cast
from tileplug.reference.quant.per_block_cast_lossless import per_block_cast_lossless
from tileplug.reference.quant.per_channel_cast import per_channel_cast
from tileplug.reference.quant.per_token_cast import per_token_cast
from tileplug.reference.quant.per_token_cast_and_cast_back import per_token_cast_and_cast_back
from tileplug.reference.quant.stochastic_cast import stochastic_cast
from tileplug.reference.quant.transpose_weight_sf import transpose_weight_sf
from tileplug.reference.random import draw as random_draw
from tileplug.reference.rope.apply_rotary import apply_rotary
from tileplug.reference.rope.rms_norm_rope import rms_norm_rope
from tileplug.reference.swiglu.swiglu import swiglu
from tileplug.reference.swiglu.swiglu_backward import swiglu_backward
from tileplug.reference.swiglu.swiglu_per_token_cast import swiglu_per_token_cast

PRIORITY = -1000
"""Lowest: every other backend for a device type is tried first."""

DEVICE_LAYOUTS: dict[str, LayoutTraits] = {"cuda": CUDA_LAYOUT, "npu": ASCEND_LAYOUT}


@dataclass(frozen=True)
class ReferenceKernel:
    """A reference kernel: accepts every call the contract accepts."""

    run: Callable[[Any, Any, Any], None]

    def supports(self, call: Any) -> str | None:
        return None

    def __call__(self, call: Any, inputs: Any, outputs: Any) -> None:
        self.run(call, inputs, outputs)


def layout_for(device_type: str) -> LayoutTraits:
    """The device family's layout on cuda and npu; ``config.host_layout`` on host devices."""
    return DEVICE_LAYOUTS.get(device_type) or config.current().host_layout


def make_backend() -> Backend:
    """The reference backend object."""
    return Backend(
        name="reference",
        device_types=(ANY_DEVICE,),
        priority=PRIORITY,
        traits=CUDA_LAYOUT,
        kernels={
            "per_token_cast": ReferenceKernel(per_token_cast),
            "per_token_cast_and_cast_back": ReferenceKernel(per_token_cast_and_cast_back),
            "per_block_cast": ReferenceKernel(per_block_cast),
            "per_channel_cast": ReferenceKernel(per_channel_cast),
            "cast_back": ReferenceKernel(cast_back),
            "per_block_cast_lossless": ReferenceKernel(per_block_cast_lossless),
            "transpose_weight_sf": ReferenceKernel(transpose_weight_sf),
            "stochastic_cast": ReferenceKernel(stochastic_cast),
            "nearest_cast": ReferenceKernel(nearest_cast),
            "rms_norm": ReferenceKernel(rms_norm),
            "layer_norm": ReferenceKernel(layer_norm),
            "rms_norm_per_token_cast": ReferenceKernel(rms_norm_per_token_cast),
            "rms_norm_backward": ReferenceKernel(rms_norm_backward),
            "layer_norm_backward": ReferenceKernel(layer_norm_backward),
            "apply_rotary": ReferenceKernel(apply_rotary),
            "rms_norm_rope": ReferenceKernel(rms_norm_rope),
            "topk_gate": ReferenceKernel(moe_gate.topk_gate),
            "normalize_weight": ReferenceKernel(moe_gate.normalize_weight),
            "moe_topk_gate": ReferenceKernel(moe_gate.moe_topk_gate),
            "moe_topk_gate_backward": ReferenceKernel(moe_gate.moe_topk_gate_backward),
            "moe_expert_counts": ReferenceKernel(moe_permute.moe_expert_counts),
            "moe_permute": ReferenceKernel(moe_permute.moe_permute),
            "moe_unpermute": ReferenceKernel(moe_permute.moe_unpermute),
            "swiglu": ReferenceKernel(swiglu),
            "swiglu_per_token_cast": ReferenceKernel(swiglu_per_token_cast),
            "swiglu_backward": ReferenceKernel(swiglu_backward),
            "fill_rand": ReferenceKernel(random_draw.fill_rand),
            "fill_randn": ReferenceKernel(random_draw.fill_randn),
        },
        layout_for=layout_for,
        description="exact PyTorch model of SPEC.md, any device, slow",
    )


@hookimpl
def tileplug_backends() -> list[Backend]:
    return [make_backend()]
