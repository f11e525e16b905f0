#!/usr/bin/env python3
"""Every op-table case of the norm and RoPE families at tail-tile token counts, under
``compute-sanitizer --tool memcheck`` (a script, not a pytest test: the sanitizer wraps one
process). Each case goes through the conformance check at T = 3 and T = 37, so a kernel that
reads or writes outside its tensors is reported by the sanitizer and a wrong value by the
check. The cases' kernels come from the kernel index (fill it first, outside the sanitizer):

    . .gpu-bundle/prelude.sh && python3 -m tileplug.core.cli precompile --device cuda --ops $(python3 tests/gpu/sanitize_tails.py --ops)
    compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu/sanitize_tails.py
    python3 tests/gpu/sanitize_tails.py --tokens 3,4001   # without the sanitizer: the same check at other T
"""

from __future__ import annotations

import sys

OPS = ("rms_norm", "layer_norm", "rms_norm_per_token_cast", "rms_norm_backward", "layer_norm_backward",
       "apply_rotary", "rms_norm_rope", "rms_norm_rope_per_token_cast")
TOKENS = (3, 37)


def main() -> int:
    if "--ops" in sys.argv:
        print(",".join(OPS))
        return 0
    from tileplug.core import opdefs
    from tileplug.reference.conformance import CaseDeclined, check_case

    tokens_list = TOKENS
    if "--tokens" in sys.argv:
        tokens_list = tuple(int(value) for value in sys.argv[sys.argv.index("--tokens") + 1].split(","))
    checked = declined = 0
    for op in OPS:
        for case in opdefs.get(op).cases():
            for tokens in tokens_list:
                try:
                    check_case(case, tokens, "cuda", "cuda")
                    checked += 1
                except CaseDeclined:
                    declined += 1
    print(f"sanitize_tails: {checked} case runs checked on cuda at T in {tokens_list}, {declined} declined "
          "(served by the reference)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
