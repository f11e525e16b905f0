"""Checks on a lowered Ascend kernel that can fail (used by tests/test_ascend_lowering.py).

They inspect what TileLang's Ascend pipeline produced -- UB byte counts taken from the lowered
artifact and the traced prim_func (:func:`compiler_ub_bytes`, :func:`primfunc_ub_bytes`), and
the Ascend C -- never an execution. Each check returns ``(ok, detail)``.

* :func:`check_ub` -- UB within the budget. Three numbers must agree and fit: the compiler's
  merged UB size (device function attribute ``dyn_shared_memory_buf``), the prim_func's
  ``alloc_shared`` buffers x annotated versions (32-byte aligned), and the backend's plan.
* :func:`check_pipelined` -- every row loop ``for (int32_t it...)`` of the kernel rotates UB
  slots by ``(it & N)`` / ``(it % N)`` with >= 2 versions, waits on rotating events, and the
  prologue arms >= 2 event ids for the loop's first stage (the MTE2 loads; the vector unit in
  a loop that only computes and stores, as the random-number draws).
* :func:`check_vector` -- the hot loop is SIMD: a ``__simd_vf__`` function with vector loads and
  stores is called inside every row loop; the ``__global__`` function never dereferences UB as
  a scalar; nothing is synchronised on the scalar pipe (``PIPE_S``).
* :func:`check_deterministic` -- a kernel that reduces over rows (the norm backward's weight
  gradient) arms no store-mode atomic (``asc_set_atomic_*``: its order of accumulation would
  vary) and lowers to the same Ascend C whatever the vector-core count (its split of the rows
  is a constant, never the device's).
"""

from __future__ import annotations

import re

from tileplug.core.quant.sf_math import align


def compiler_ub_bytes(artifact) -> int:
    """The compiler's merged UB bytes of a lowered artifact (0 when it allocates none)."""
    for _, func in artifact.device_mod.functions.items():
        if func.attrs is not None and "dyn_shared_memory_buf" in func.attrs:
            return int(func.attrs["dyn_shared_memory_buf"])
    return 0


def primfunc_ub_bytes(prim_func) -> int:
    """UB bytes of a traced prim_func: each ``alloc_shared`` buffer x its annotated versions,
    each version 32-byte aligned (how TileLang's Ascend UB merge lays them out)."""
    import tvm
    from tvm import tirx
    from tvm.tirx import stmt_functor

    total = [0]

    def visit(node):
        if isinstance(node, tirx.SBlock):
            versions = {}
            vmap = node.annotations.get("tl.buffer_versions_map") if node.annotations else None
            if vmap is not None:
                versions = {var: int(n) for var, n in vmap.items()}
            for buf in node.alloc_buffers:
                if buf.scope() not in ("shared.dyn", "shared"):
                    continue
                count = 1
                for dim in buf.shape:
                    count *= int(dim)
                dtype = tvm.DataType(str(buf.dtype))
                nbytes = count * dtype.bits * dtype.lanes // 8
                total[0] += versions.get(buf.data, 1) * align(nbytes, 32)

    stmt_functor.post_order_visit(prim_func.body, visit)
    return total[0]


def check_ub(compiler: int, traced: int, plan_bytes: int, budget: int) -> tuple[bool, str]:
    """``compiler`` / ``traced``: :func:`compiler_ub_bytes` / :func:`primfunc_ub_bytes` of the
    lowering; ``plan_bytes``: the backend's UB plan; ``budget``: UB bytes per vector core."""
    numbers = f"compiler={compiler} prim_func={traced} plan={plan_bytes} budget={budget}"
    if max(compiler, traced, plan_bytes) > budget:
        return False, "UB over budget: " + numbers
    if not compiler == traced == plan_bytes:
        return False, "UB footprints disagree: " + numbers
    return True, numbers


def _closing_brace(text: str, opening: int) -> int:
    """Index of the ``}`` matching the ``{`` at ``opening`` (``len(text)`` if unbalanced)."""
    depth = 0
    for j in range(opening, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(text)


def _functions(source: str) -> dict[str, str]:
    funcs = {}
    position = 0
    for match in re.finditer(r"^(.*\)\s*)\{\s*$", source, re.M):
        if match.start() < position:
            continue
        j = _closing_brace(source, match.end() - 1)
        funcs[match.group(1).strip()] = source[match.end():j]
        position = j
    return funcs


def _row_loops(body: str) -> list[tuple[str, str, str]]:
    """(loop variable, text before the loop, loop body) of each top-level ``for (int32_t it...``."""
    loops = []
    for match in re.finditer(r"^  for \(int32_t (it\w*) = 0; .*\) \{$", body, re.M):
        j = _closing_brace(body, match.end() - 1)
        loops.append((match.group(1), body[:match.start()], body[match.end():j]))
    return loops


def _global(source: str) -> str | None:
    for signature, body in _functions(source).items():
        if "__global__" in signature:
            return body
    return None


def _ub_names(body: str) -> str:
    """Regex alternation of the UB base pointers the ``__global__`` body declares
    (``buf_dyn_shmem`` when TileLang merges several buffers; the buffer's own name when the
    kernel has one UB buffer)."""
    names = re.findall(r"__ubuf__ \w+ \*(\w+) = \(__ubuf__ \w+ \*\)0;", body) or ["buf_dyn_shmem"]
    return "|".join(re.escape(name) for name in names)


def check_pipelined(source: str) -> tuple[bool, str]:
    body = _global(source)
    if body is None:
        return False, "no __global__ function"
    loops = _row_loops(body)
    ub = _ub_names(body)
    if not loops:
        return False, "no row loop `for (int32_t it ...)` in the kernel"
    details = []
    ok = True
    for var, before, loop in loops:
        versions = {int(n) + 1 for n in re.findall(rf"\({var} & (\d+)\)", loop)}
        versions |= {int(n) for n in re.findall(rf"\({var} % (\d+)\)", loop)}
        waits = re.findall(rf"asc_sync_wait\(PIPE_\w+, PIPE_\w+, static_cast<event_t>\(\(?{var} [&%]", loop)
        first = "MTE2" if "asc_copy_gm2ub" in loop else "V"  # the stage that first fills a rotating buffer
        armed = set(re.findall(rf"asc_sync_notify\(PIPE_\w+, PIPE_{first}, static_cast<event_t>\((\d+)\)\)", before))
        rotates = re.search(rf"(?:{ub})\)?\[\(*\({var} [&%] \d+\)", loop) is not None
        this_ok = bool(versions) and max(versions) >= 2 and rotates and bool(waits) and len(armed) >= 2
        ok = ok and this_ok
        details.append(
            f"{var}: versions={sorted(versions) or [1]} ub_rotates={rotates} rotating_waits={len(waits)} "
            f"armed={sorted(armed)}"
        )
    return ok, "; ".join(details)


def check_vector(source: str) -> tuple[bool, str]:
    funcs = _functions(source)
    simd = {sig: body for sig, body in funcs.items() if "__simd_vf__" in sig}
    body = _global(source)
    why = []
    vector_fns = [
        re.search(r"void (\w+)\(", sig).group(1)
        for sig, b in simd.items()
        if "simd_inst::vlds" in b and "simd_inst::vsts" in b
    ]
    if not vector_fns:
        why.append("no __simd_vf__ function with vector loads and stores")
    loops = _row_loops(body or "")
    if not loops or not all(any(name + "(" in loop for name in vector_fns) for _, _, loop in loops):
        why.append("a row loop calls no SIMD vector function")
    if body is not None:
        ub = _ub_names(body)
        scalar = [
            m.start() for m in re.finditer(rf"\*\)(?:{ub})\)\[|(?<![\w*])(?:{ub})\[", body)
            if body[max(0, m.start() - 40):m.start()].rfind("&(") < 0
        ]
        if scalar:
            why.append(f"{len(scalar)} scalar UB dereference(s) in the __global__ function")
    if "PIPE_S" in source:
        why.append("PIPE_S synchronisation: data work on the scalar pipe")
    count = sum(len(re.findall(r"simd_inst::\w+", b)) for b in simd.values())
    return not why, "; ".join(why) if why else f"{count} simd_inst calls in {len(simd)} __simd_vf__ function(s)"


def check_deterministic(source: str, other_cores_source: str) -> tuple[bool, str]:
    """``source``: a lowering; ``other_cores_source``: the same specialisation lowered for another
    vector-core count."""
    why = []
    atomics = sorted(set(re.findall(r"asc_set_atomic_(?!none)\w+", source)))
    if atomics:
        why.append(f"store-mode atomics armed ({', '.join(atomics)}): the order of accumulation varies")
    if source != other_cores_source:
        why.append("the Ascend C differs with the vector-core count: the split of the rows depends on the device")
    return not why, "; ".join(why) if why else "no atomics; the same Ascend C for every vector-core count"
