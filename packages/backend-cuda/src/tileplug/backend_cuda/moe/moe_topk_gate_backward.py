"""CUDA ``moe_topk_gate_backward`` (SPEC §7): the gradient of the routed weights with respect
to the logits, through the scoring function, in fp32.

With the forward's scores ``u`` (unbiased), slots ``i`` whose index ``e_i`` lies in
``[0, E)`` (−1 and shared-expert slots carry no gradient), ``g_i`` the incoming gradient and
``c = routed_scaling_factor``:

- weights ``w_i = c · u[e_i] / D`` with ``D = Σ_i u[e_i] + 1e-20`` (``renormalize``), else
  ``w_i = c · u[e_i]``; slot ``i`` adds ``(c / D) · (g_i − P / D)`` with ``P = Σ_r g_r · u[e_r]``
  (renormalize), else ``c · g_i``, to column ``e_i`` in slot order (the reference's
  operations and order: repeated experts accumulate);
- softmax ``∂L/∂x = u · (∂L/∂u − Σ_e u[e] · ∂L/∂u[e])``; sigmoid ``∂L/∂u · u · (1 − u)``;
  sqrtsoftplus (``u = sqrt(softplus(x))``) ``∂L/∂u · sigmoid(x) / (2u)`` with
  ``sigmoid(x) = −expm1(−u²)`` (0 where ``u = 0``). A row without a routed slot gets zeros.

A masked row (``mask[t]`` False) gets zeros. One warp per row (``warp_topk.WarpRow``): lane
``i`` loads slot ``i`` (K ≤ 32), each slot is broadcast in slot order (the sums' order is fixed:
deterministic and batch-invariant), the row sum of softmax is the lane's values in column
order then the warp's butterfly.

No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.
"""

import tilelang.language as T

from tileplug.backend_cuda.moe.spec import GateSpec
from tileplug.backend_cuda.moe.warp_topk import WARP, WarpRow

RENORMALIZE_EPSILON = 1e-20


def build(spec: GateSpec):
    """The ``T.prim_func`` of a backward specialisation: ``(scores, topk_idx, grad_topk_weights,
    mask, grad_logits)``, an absent mask replaced by the scores (never read)."""
    row = WarpRow(spec.experts, spec.vec)
    E, K = spec.experts, spec.topk
    WARPS = spec.warps
    VALUES = row.VALUES
    ENTRIES = row.entries
    SCALING = spec.scaling
    SCORING = spec.scoring
    assert K <= WARP
    rows = T.dynamic("T")
    scores_t = T.StridedTensor((rows, E), (T.dynamic("S0"), 1), "float32")
    idx_t = T.StridedTensor((rows, K), (T.dynamic("I0"), 1), spec.index_dtype)
    grad_t = T.StridedTensor((rows, K), (T.dynamic("G0"), 1), "float32")
    mask_t = T.Tensor((rows,), "bool") if spec.masked else \
        T.StridedTensor((T.dynamic("mA"), T.dynamic("mB")), (T.dynamic("mC"), 1), "float32")
    out_t = T.Tensor((rows, E), "float32")

    @T.prim_func
    def kernel(scores: scores_t, topk_idx: idx_t, grad_topk_weights: grad_t, mask: mask_t, grad_logits: out_t):
        with T.Kernel(T.ceildiv(rows, WARPS), threads=WARPS * WARP) as bx:
            if spec.vec > 1:
                T.assume(scores_t.strides[0] % spec.vec == 0)
            tx = T.get_thread_binding()
            lane = tx % WARP
            t = bx * WARPS + tx // WARP
            if t < rows:
                u = T.alloc_local((VALUES,), "float32")
                grad = T.alloc_local((VALUES,), "float32")
                slot_expert = T.alloc_local((1,), "int32")
                slot_grad = T.alloc_local((1,), "float32")
                expert = T.alloc_local((1,), "int32")
                g = T.alloc_local((1,), "float32")
                picked = T.alloc_local((1,), "float32")
                total = T.alloc_local((1,), "float32")  # Σ u[e_i]
                product = T.alloc_local((1,), "float32")  # Σ g_i · u[e_i]
                acc = T.alloc_local((1,), "float32")
                active = T.alloc_local((1,), "int32")
                row.load_row(scores, t, lane, u)
                slot_expert[0] = -1
                slot_grad[0] = T.float32(0.0)
                if lane < K:
                    index = topk_idx[t, lane]
                    slot_expert[0] = T.if_then_else(T.And(index >= 0, index < E), T.cast(index, "int32"), -1)
                    slot_grad[0] = grad_topk_weights[t, lane]
                if spec.masked:
                    if not mask[t]:
                        slot_expert[0] = -1
                for i in ENTRIES:
                    grad[i] = T.float32(0.0)
                total[0] = T.float32(0.0)
                product[0] = T.float32(0.0)
                active[0] = 0
                for s in T.serial(K):  # the routed scores' sum and Σ g·u, in slot order
                    expert[0] = T.shfl_sync(slot_expert[0], s)
                    g[0] = T.shfl_sync(slot_grad[0], s)
                    if expert[0] >= 0:
                        active[0] = 1
                        picked[0] = T.float32(0.0)
                        for i in ENTRIES:
                            if row.column(i, lane) == expert[0]:
                                picked[0] = u[i]
                        picked[0] = row.broadcast(picked[0], expert[0])
                        total[0] = T.ieee_add(total[0], picked[0])
                        product[0] = T.ieee_add(product[0], T.ieee_mul(g[0], picked[0]))
                denominator = T.ieee_add(total[0], T.float32(RENORMALIZE_EPSILON))
                inner = T.ieee_fdiv(product[0], denominator)
                factor = T.ieee_fdiv(T.float32(SCALING), denominator)
                for s in T.serial(K):  # each slot's ∂L/∂u added to its expert's column, in slot order
                    expert[0] = T.shfl_sync(slot_expert[0], s)
                    g[0] = T.shfl_sync(slot_grad[0], s)
                    if expert[0] >= 0:
                        for i in ENTRIES:
                            if row.column(i, lane) == expert[0]:
                                if spec.renormalize:
                                    grad[i] = T.ieee_add(grad[i], T.ieee_mul(factor, T.ieee_sub(g[0], inner)))
                                else:
                                    grad[i] = T.ieee_add(grad[i], T.ieee_mul(T.float32(SCALING), g[0]))
                if SCORING == "softmax":
                    acc[0] = T.float32(0.0)
                    for i in ENTRIES:
                        if row.present(i, lane) is True:
                            acc[0] = T.ieee_add(acc[0], T.ieee_mul(u[i], grad[i]))
                        else:
                            if row.present(i, lane):
                                acc[0] = T.ieee_add(acc[0], T.ieee_mul(u[i], grad[i]))
                    dot = T.warp_reduce_sum(acc[0])
                    for i in ENTRIES:
                        grad[i] = T.ieee_mul(u[i], T.ieee_sub(grad[i], dot))
                elif SCORING == "sigmoid":
                    for i in ENTRIES:
                        grad[i] = T.ieee_mul(grad[i], T.ieee_mul(u[i], T.ieee_sub(T.float32(1.0), u[i])))
                else:
                    for i in ENTRIES:
                        slope = T.ieee_fdiv(
                            T.ieee_sub(T.float32(0.0),
                                       T.call_extern("float32", "expm1f",
                                                     T.ieee_sub(T.float32(0.0), T.ieee_mul(u[i], u[i])))),
                            T.ieee_mul(T.float32(2.0), u[i]))
                        grad[i] = T.if_then_else(u[i] > T.float32(0.0), T.ieee_mul(grad[i], slope), T.float32(0.0))
                if active[0] == 0:  # no routed slot (or masked): zeros, whatever the scores hold
                    for i in ENTRIES:
                        grad[i] = T.float32(0.0)
                row.store_row(grad_logits, t, lane, grad)

    return kernel.with_attr("global_symbol", spec.name)
