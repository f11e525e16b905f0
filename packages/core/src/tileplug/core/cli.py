"""The ``tileplug`` command: info, demo, bench, lower, ledger."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

OP_NAMES = ("per_token_cast", "per_block_cast", "per_channel_cast", "cast_back")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _default_device() -> torch.device:
    from tileplug.core.registry import registry

    for backend in registry.backends:
        if backend.unavailable_reason() is None:
            for device_type in backend.device_types:
                if device_type in ("cuda", "npu"):
                    return torch.device(device_type)
    return torch.device("cpu")


def _representative_call(op_name: str, device_type: str):
    """The op's default call at [1, 7168] described on a meta tensor, re-homed to ``device_type``."""
    from tileplug.core import ops
    from tileplug.core.lowering import describe_call

    x = torch.empty(1, 7168, dtype=torch.bfloat16, device="meta")
    if op_name == "cast_back":
        q = torch.empty(1, 7168, dtype=torch.float8_e4m3fn, device="meta")
        sf = torch.empty(1, 56, dtype=torch.float32, device="meta")
        call, _ = describe_call(ops.cast_back, (q, sf), "bf16", x_block_size=(1, 128))
    else:
        call, _ = describe_call(getattr(ops, op_name), x)
    return dataclasses.replace(call, device_type=device_type)


# ---------------------------------------------------------------------- info


def command_info(args: argparse.Namespace) -> int:
    from tileplug.core.registry import BACKEND_ENV_VARIABLE, registry

    print("tileplug backends (entry-point group 'tileplug.backends')")
    rows = []
    for backend in registry.backends:
        why = backend.unavailable_reason()
        rows.append(
            (
                backend.name,
                backend.distribution,
                backend.version,
                ",".join(backend.device_types),
                backend.priority,
                "available" if why is None else f"unavailable: {why}",
            )
        )
    print(_table(("backend", "distribution", "version", "devices", "priority", "status"), rows))
    # One row per fault: a plugin that failed as a whole, or each backend it handed back
    # that was refused (malformed, reserved or taken name).
    failed = [(r.name, r.distribution, r.version, fault) for r in registry.records for fault in r.faults]
    if failed:
        print("\nplugins that failed to load (or backends they provided that were refused)")
        print(_table(("entry point", "distribution", "version", "error"), failed))
    forced = registry.forced()
    if forced:
        print(f"\nforced backend(s): {', '.join(forced)} ({BACKEND_ENV_VARIABLE} or use_backend)")
    print("\nop x backend (default flags, [1, 7168] bf16 on the backend's own device type)")
    backends = registry.backends
    matrix = []
    for op_name in OP_NAMES:
        line: list[str] = [op_name]
        for backend in backends:
            kernel = backend.kernels.get(op_name)
            if kernel is None:
                line.append("-")
                continue
            device_type = next((d for d in backend.device_types if d != "*"), "cpu")
            try:
                why = kernel.supports(_representative_call(op_name, device_type))
            except Exception as error:  # noqa: BLE001 - report, never crash info
                why = f"supports() raised {type(error).__name__}"
            line.append("yes" if why is None else f"no ({why})")
        matrix.append(line)
    print(_table(("op",) + tuple(b.name for b in backends), matrix))
    for backend in backends:
        if backend.capabilities is not None:
            try:
                text = backend.capabilities()
            except Exception as error:  # noqa: BLE001 - report, never crash info
                text = f"capabilities() raised {type(error).__name__}: {error}"
            print(f"\n{backend.name}: {text}")
    print("\n'-' = no kernel for the op; unavailable backends are shown with what they would accept.")
    return 0


# ---------------------------------------------------------------------- demo


def command_demo(args: argparse.Namespace) -> int:
    from tileplug.core import ops
    from tileplug.core.benchmark import median_seconds
    from tileplug.core.lowering import describe_call
    from tileplug.core.registry import registry
    from tileplug.reference.testing import activation, relative_error

    device = torch.device(args.device) if args.device else _default_device()
    tokens, hidden = args.tokens, args.hidden
    x = activation(tokens, hidden, dtype=torch.bfloat16, device=device)
    print(f"\ndemo: quantize a [{tokens}, {hidden}] bf16 activation (with outlier channels) on {device.type}")
    cases = [
        ("per_token_cast e4m3 g128", ops.per_token_cast, {}, (1, 128)),
        ("per_token_cast e4m3 g128 ue8m0", ops.per_token_cast,
         {"round_sf": True, "use_packed_ue8m0": True, "use_tma_aligned_col_major_sf": True}, (1, 128)),
        ("per_token_cast e2m1 g16", ops.per_token_cast, {"fmt": "e2m1", "num_per_channels": 16}, (1, 16)),
        ("per_block_cast e4m3 128x128", ops.per_block_cast, {"block_size": (128, 128)}, (128, 128)),
        ("per_channel_cast e4m3 128", ops.per_channel_cast, {"num_per_tokens": 128}, (128, 1)),
    ]
    rows = []
    for label, op, kwargs, block in cases:
        call, _ = describe_call(op, x, **kwargs)
        backend, _ = registry.select(call.op, call)
        q, sf = op(x, **kwargs)
        restored = ops.cast_back((q, sf), "fp32", x_block_size=block)
        error = relative_error(restored, x.float())
        seconds = median_seconds(lambda: op(x, **kwargs), device)
        ledger = call.ledger(backend.traits_for(device.type))
        back_call, _ = describe_call(ops.cast_back, (q, sf), "bf16", x_block_size=block)
        back_seconds = median_seconds(lambda: ops.cast_back((q, sf), "bf16", x_block_size=block), device)
        back_bytes = back_call.ledger(backend.traits_for(device.type)).bytes_total
        rows.append((
            label, backend.name, f"{tuple(q.shape)} {str(q.dtype).replace('torch.', '')}",
            f"{tuple(sf.shape)} {str(sf.dtype).replace('torch.', '')}", f"{error:.4f}",
            f"{seconds * 1e6:.0f}", f"{ledger.bytes_total / seconds / 1e9:.2f}",
            f"{back_bytes / back_seconds / 1e9:.2f}",
        ))
    print(_table(("op", "backend", "q", "sf", "round-trip rel err", "us", "GB/s", "cast_back GB/s"), rows))
    print("round-trip rel err = ||cast_back(q, sf) - x|| / ||x||; GB/s = ledger bytes / median time")
    return 0


# ---------------------------------------------------------------------- bench


def command_bench(args: argparse.Namespace) -> int:
    from tileplug.core.benchmark import (
        BenchReport,
        bench_cases,
        copy_bandwidth,
        device_name,
        dispatch_cost,
        measure_case,
    )
    from tileplug.core.registry import registry

    device = torch.device(args.device) if args.device else _default_device()
    cases = bench_cases()
    chosen = args.ops.split(",") if args.ops else list(cases)
    unknown = [name for name in chosen if name not in cases]
    if unknown:
        print(f"unknown op case(s): {', '.join(unknown)}; known: {', '.join(cases)}", file=sys.stderr)
        return 2
    tokens_list = [int(t) for t in args.tokens.split(",")]
    backends = (
        args.backends.split(",")
        if args.backends
        else [b.name for b in registry.backends if b.serves(device.type) and b.unavailable_reason() is None]
    )
    log = (lambda text: print(text, file=sys.stderr)) if args.verbose else (lambda text: None)
    report = BenchReport(device.type, device_name(device), copy_bandwidth(device), torch.__version__)
    if not args.no_compile:
        # The peer gets a fresh dynamo cache per op case and room to specialise on every
        # size; should it still hit the limit, it raises (reported as "did not compile")
        # instead of silently timing eager PyTorch.
        import torch._dynamo as dynamo

        dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 4 * len(tokens_list))
        dynamo.config.fail_on_recompile_limit_hit = True
    for name in chosen:
        if not args.no_compile:
            dynamo.reset()
        for tokens in tokens_list:
            report.rows.extend(
                measure_case(
                    cases[name], tokens, args.hidden, DTYPES[args.dtype], device, backends, report.copy_gbps,
                    with_compile=not args.no_compile, with_host_time=tokens in (1,), log=log,
                )
            )
    if not args.no_dispatch:
        report.dispatch = dispatch_cost(device, args.hidden)
    print(f"device: {report.device} ({report.device_name}); copy ceiling {report.copy_gbps:.1f} GB/s; "
          f"torch {report.torch_version}")
    rows = [
        (
            r.case, r.tokens, r.hidden, r.runner,
            "" if r.median_us is None else f"{r.median_us:.1f}",
            "" if r.gbps is None else f"{r.gbps:.2f}",
            "" if r.pct_of_copy is None else f"{r.pct_of_copy:.1f}%",
            "" if r.host_us is None else f"{r.host_us:.1f}",
            r.note,
        )
        for r in report.rows
    ]
    print(_table(("op", "T", "H", "runner", "median us", "GB/s", "% of copy", "host us/call", "note"), rows))
    if report.dispatch:
        d = report.dispatch
        print(
            f"\ndispatch cost, per_token_cast [1, {args.hidden}] on {device.type} via '{d['backend']}': "
            f"core.ops call {d['core_call_us']:.1f} us; kernel called directly {d['direct_kernel_us']:.1f} us "
            f"(preallocated outputs), {d['direct_kernel_fresh_outputs_us']:.1f} us (fresh torch.empty outputs); "
            f"dispatch overhead {d['dispatch_overhead_us']:.1f} us (contract check alone {d['contract_check_us']:.1f} us)"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report.as_dict(), handle, indent=2)
        print(f"\nwrote {args.json}")
    return 0


# ---------------------------------------------------------------------- lower, ledger


def _call_arguments(args: argparse.Namespace):
    from tileplug.core import ops

    op = getattr(ops, args.op)
    x = torch.empty(args.tokens, args.hidden, dtype=DTYPES[args.dtype], device="meta")
    kwargs: dict[str, Any] = {}
    for item in args.option or []:
        key, _, value = item.partition("=")
        kwargs[key] = json.loads(value) if value[:1] in "[{0123456789-tf" and value not in ("e4m3", "e2m1") else value
        if isinstance(kwargs[key], list):
            kwargs[key] = tuple(kwargs[key])
    return op, x, kwargs


def command_lower(args: argparse.Namespace) -> int:
    from tileplug.core.lowering import lower

    op, x, kwargs = _call_arguments(args)
    print(lower(op, x, backend=args.backend, **kwargs))
    return 0


def command_ledger(args: argparse.Namespace) -> int:
    from tileplug.core.lowering import describe_call
    from tileplug.core.quant.layouts import LAYOUTS

    op, x, kwargs = _call_arguments(args)
    call, _ = describe_call(op, x, **kwargs)
    ledger = call.ledger(LAYOUTS[args.layout])
    print(json.dumps({"op": args.op, "tokens": args.tokens, "hidden": args.hidden, **ledger._asdict(),
                      "bytes_total": ledger.bytes_total}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tileplug", description="tileplug: pluggable memory-bound LLM kernels")
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("info", help="installed backends, availability and the op x backend matrix")

    demo = commands.add_parser("demo", help="quantize a realistic activation with each quant op")
    demo.add_argument("--device", help="cpu, cuda, npu (default: the best available)")
    demo.add_argument("--tokens", type=int, default=512)
    demo.add_argument("--hidden", type=int, default=7168)

    bench = commands.add_parser("bench", help="ops x sizes on every available backend, with the copy ceiling")
    bench.add_argument("--device", help="cpu, cuda, npu (default: the best available)")
    bench.add_argument("--ops", help="comma-separated op cases (default: all)")
    bench.add_argument("--tokens", default="1,16,128,1024", help="comma-separated token counts")
    bench.add_argument("--hidden", type=int, default=7168)
    bench.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    bench.add_argument("--backends", help="comma-separated backend names (default: all available for the device)")
    bench.add_argument("--no-compile", action="store_true", help="skip the torch.compile(reference) peer")
    bench.add_argument("--no-dispatch", action="store_true", help="skip the dispatch-cost measurement")
    bench.add_argument("--json", help="also write the report as JSON to this path")
    bench.add_argument("--verbose", action="store_true", help="log progress to stderr")

    for name, helptext in (("lower", "generated device source of one specialisation"),
                           ("ledger", "bytes and flops one call must move")):
        sub = commands.add_parser(name, help=helptext)
        sub.add_argument("op", choices=[n for n in OP_NAMES if n != "cast_back"] + [
            "per_token_cast_with_sf_only", "per_token_cast_with_precomputed_sf",
            "per_block_cast_with_sf_only", "per_block_cast_with_precomputed_sf"])
        sub.add_argument("--tokens", type=int, default=1)
        sub.add_argument("--hidden", type=int, default=7168)
        sub.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
        sub.add_argument("--option", "-o", action="append", help="op keyword, e.g. -o fmt=e2m1 -o round_sf=true")
        if name == "lower":
            sub.add_argument("--backend", required=True)
        else:
            sub.add_argument("--layout", choices=("cuda", "ascend"), default="cuda")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "info": command_info,
        "demo": command_demo,
        "bench": command_bench,
        "lower": command_lower,
        "ledger": command_ledger,
    }
    try:
        return handlers[args.command](args)
    except Exception as error:
        from tileplug.core.errors import TileplugError

        if isinstance(error, TileplugError):
            print(f"tileplug {args.command}: {error}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    raise SystemExit(main())
