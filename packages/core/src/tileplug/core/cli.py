"""The ``tileplug`` command: info, demo, bench, precompile, lower, ledger.

Every command is derived from the op table (``tileplug.core.opdefs``): the ``info`` matrix
has a row per declared op, ``lower`` and ``ledger`` accept every declared op, ``bench``
times every op's bench cases and ``demo`` quantizes with every bench case of an op that
returns a ``(q, sf)`` pair; ``precompile`` compiles the kernels of every case and bench
case. No op is named here except the demo's inverse (``cast_back``), the demo's attention
step (``DEMO_QK_STEP``: the fused QK op and the three ops it fuses, run with hand-made
inputs), its MoE routing step (``DEMO_MOE_STEP``: the routing ops of a DeepSeek-style router
in the order a layer calls them) and the default cases of the dispatch-cost measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

DEMO_INVERSE = "cast_back"
"""The op ``demo`` round-trips each ``(q, sf)`` pair through (it dequantizes any layout)."""

DEMO_QK_STEP = ("rms_norm_rope_per_token_cast", ("rms_norm", "apply_rotary", "per_token_cast"))
"""The attention step ``demo`` runs after the casts: the fused QK-norm + RoPE + FP8 op and the
chain of ops it fuses (their results must be the same bytes)."""
DEMO_HEADS, DEMO_HEAD_DIM = 32, 128

DEMO_MOE_STEP = ("moe_topk_gate", "moe_expert_counts", "moe_permute", "moe_unpermute")
"""The MoE layer step ``demo`` runs: route, count, permute, (the experts in torch), unpermute."""
DEMO_ROUTER = {"num_experts": 256, "num_topk": 8, "scoring": "sigmoid", "num_groups": 8, "topk_groups": 4,
               "routed_scaling_factor": 2.5}
"""DeepSeek-V3's router: 256 experts, top-8 from the best 4 of 8 groups, sigmoid scores with
a selection bias, renormalized and scaled by 2.5."""
DEMO_EXPERT_HIDDEN, DEMO_EXPERT_INTERMEDIATE, DEMO_ALIGNMENT = 256, 64, 8

DEFAULT_DISPATCH_CASES = "per_token_cast,cast_back"
"""Bench cases whose dispatch cost ``bench`` measures at T = 1 unless told otherwise."""

REPRESENTATIVE_SHAPE = (1, 7168)
"""[T, H] of the info matrix's call for an op's bench case (a Case brings its own H)."""

INSTALL_HINT = (
    "no backend is installed: pip install ./packages/reference (or tileplug-reference; "
    "tileplug-backend-cuda on NVIDIA hosts, tileplug-backend-ascend on Ascend hosts)"
)

EPILOG = """\
exit status:
  0  success
  2  the command as typed cannot be done: a bad or unknown argument, op, option, backend or
     device, or a call the op's contract or the named backend rejects (one line on stderr)
  1  a failure while running: a backend's kernel raised, or an internal error (one line on
     stderr; set TILEPLUG_DEBUG=1 to see the traceback)
A closed output pipe (tileplug info | head -1) ends the command quietly.
"""


class UsageError(Exception):
    """The command line asks for something that cannot be done: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (raised, reported by :func:`main` with exit status 2)."""

    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(f"{self.prog}: {message}")


# ---------------------------------------------------------------------- argument types


def _integer(minimum: int, what: str):
    """An argparse type: an integer >= ``minimum``, described as ``what`` in its error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_count = _integer(0, "an integer >= 0")
"""A token count."""
_positive = _integer(1, "a positive integer")


def _counts(text: str) -> list[int]:
    """Comma-separated token counts, e.g. ``1,16,128``."""
    parts = [part.strip() for part in text.split(",")]
    if not parts or any(not part for part in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    values = []
    for part in parts:
        try:
            values.append(_count(part))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers >= 0, got {text!r} ({part!r} is not one)") from None
    return values


def _peer_names() -> list[str]:
    from tileplug.core.benchmark import PEERS

    return list(PEERS)


def _names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",")]
    if any(not name for name in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _tuples(value: Any) -> Any:
    """JSON lists become tuples (the ops take shapes as tuples), recursively."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def parse_value(text: str) -> Any:
    """An option value: JSON when it parses (true, 3, 1.5, [1, 128] → a tuple, null), else the string."""
    try:
        return _tuples(json.loads(text))
    except ValueError:
        return text


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key, parse_value(value)


# ---------------------------------------------------------------------- helpers


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _one_line(text: Any, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _default_device() -> torch.device:
    from tileplug.core.registry import registry

    for backend in registry.backends:
        if backend.unavailable_reason() is None:
            for device_type in backend.device_types:
                if device_type in ("cuda", "npu"):
                    return torch.device(device_type)
    return torch.device("cpu")


def _device(text: str | None) -> torch.device:
    """The ``--device`` asked for, checked to exist here (UsageError otherwise)."""
    if not text:
        return _default_device()
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise UsageError(f"unknown device {text!r} (e.g. cpu, cuda, cuda:1, npu)") from None
    if device.type == "meta":
        raise UsageError("device 'meta' holds no data, so nothing can run or be timed on it")
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        is_available = getattr(module, "is_available", None)
        try:
            available = bool(is_available()) if is_available is not None else False
        except Exception:  # noqa: BLE001 - a probe that raises means "not here"
            available = False
        if not available:
            raise UsageError(f"device {text!r} is not available on this machine "
                             f"(torch.{device.type}.is_available() is not true)")
    try:
        torch.empty(1, device=device)
    except Exception as error:  # noqa: BLE001 - e.g. cuda:7 on a one-GPU host
        raise UsageError(f"device {text!r} cannot be used here: {_one_line(error, 160)}") from None
    return device


def _opdef(name: str):
    from tileplug.core import opdefs

    try:
        return opdefs.get(name)
    except KeyError:
        raise UsageError(f"unknown op {name!r}; declared ops: {', '.join(opdefs.names())}") from None


def _backend(name: str):
    from tileplug.core.registry import registry

    backend = registry.get(name)
    if backend is None:
        installed = ", ".join(b.name for b in registry.backends) or "none"
        raise UsageError(f"unknown backend {name!r} (installed: {installed})")
    return backend


def _own_device_type(backend) -> str:
    """The device type a backend is shown on: its first named one (the reference's '*': cpu)."""
    return next((d for d in backend.device_types if d != "*"), "cpu")


def _mentions_tensor(annotation: Any) -> bool:
    if annotation is torch.Tensor:
        return True
    return any(_mentions_tensor(a) for a in typing.get_args(annotation))


def keyword_options(opdef) -> list[str]:
    """The op's keyword arguments a command line may set: its parameters that are not tensors."""
    try:
        hints = typing.get_type_hints(opdef.function)
    except Exception:  # noqa: BLE001 - unresolvable hints: judge by the parameters alone
        hints = {}
    names = []
    for parameter in inspect.signature(opdef.function).parameters.values():
        if parameter.name == "out" or parameter.default is inspect.Parameter.empty:
            continue
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if _mentions_tensor(hints.get(parameter.name)):
            continue
        names.append(parameter.name)
    return names


def input_options(opdef) -> list[str]:
    """Input options (``-i``) the op declares (``OpDef.input_options``)."""
    return sorted(opdef.input_options)


def _options(opdef, items: Sequence[tuple[str, Any]] | None, known: list[str], flag: str, what: str) -> dict:
    options: dict[str, Any] = {}
    for key, value in items or []:
        if key not in known:
            listing = ", ".join(known) if known else "none"
            raise UsageError(f"{opdef.name}: unknown {what} {key!r} ({flag} {key}=...); known: {listing}")
        options[key] = value
    return options


def _meta_arguments(opdef, tokens: int, hidden: int, dtype: torch.dtype, kwargs: dict, inputs: dict,
                    device: torch.device | None = None) -> tuple[tuple, dict]:
    """``opdef.arguments`` on ``device`` (meta), its failures turned into one-line UsageErrors."""
    from tileplug.core.errors import TileplugError

    try:
        return opdef.arguments(tokens, hidden, dtype, dict(kwargs), dict(inputs), device or torch.device("meta"), 0)
    except TileplugError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as error:
        raise UsageError(f"{opdef.name}: cannot make its arguments with options {kwargs or {}} and inputs "
                         f"{inputs or {}}: {type(error).__name__}: {_one_line(error, 160)}") from None


def _command_call(args: argparse.Namespace, layout: Any) -> tuple[Any, Any, dict, dict]:
    """(opdef, call, kwargs, inputs) of ``lower`` / ``ledger``: meta inputs at the command
    line's shape, made and checked under ``config.host_layout(layout)``."""
    from tileplug.core import config
    from tileplug.core.opdefs import describe_call

    opdef = _opdef(args.op)
    kwargs = _options(opdef, args.option, keyword_options(opdef), "-o", "option")
    inputs = _options(opdef, args.input, input_options(opdef), "-i", "input option")
    with config.host_layout(layout):
        op_args, op_kwargs = _meta_arguments(opdef, args.tokens, args.hidden, DTYPES[args.dtype], kwargs, inputs)
        call, _ = describe_call(opdef.name, *op_args, **op_kwargs)
    return opdef, call, kwargs, inputs


def representative_call(opdef, device_type: str, traits: Any) -> tuple[Any, str]:
    """The op's call the info matrix asks each backend about, and its label: the op's first
    bench case at [1, 7168] bf16, else its first case at T = 1, built on meta under the
    backend's layout and re-homed to ``device_type``."""
    from tileplug.core import config
    from tileplug.core.opdefs import describe_call

    bench = list(opdef.bench())
    tokens, hidden = REPRESENTATIVE_SHAPE
    with config.host_layout(traits):
        if bench:
            case = bench[0]
            label = f"bench {case.name} [{tokens}, {hidden}] bf16"
            op_args, op_kwargs = case.arguments(tokens, hidden, torch.bfloat16, torch.device("meta"), 0)
        else:
            cases = list(opdef.cases())
            if not cases:
                raise LookupError("the op declares no bench case and no case")
            case = cases[0]
            label = f"case {case.id} T={tokens}"
            op_args, op_kwargs = case.arguments(tokens, "meta", 0)
        call, _ = describe_call(opdef.name, *op_args, **op_kwargs)
    return dataclasses.replace(call, device_type=device_type), label


# ---------------------------------------------------------------------- version


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the core version and those of the installed backends")

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None) -> None:
        print(version_text())
        parser.exit()


def version_text() -> str:
    import tileplug.core
    from tileplug.core.registry import registry

    lines = [f"tileplug-core {tileplug.core.__version__}"]
    for backend in registry.backends:
        lines.append(f"  backend {backend.name} {backend.version or '?'} ({backend.distribution or '?'})")
    for record in registry.records:
        if record.error is not None and not record.backends:
            lines.append(f"  plugin {record.name} {record.version} ({record.distribution}): failed to load")
    if not registry.backends:
        lines.append(f"  {INSTALL_HINT}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- info


def command_info(args: argparse.Namespace) -> int:
    from tileplug.core import opdefs
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
    if rows:
        print(_table(("backend", "distribution", "version", "devices", "priority", "status"), rows))
    else:
        print(INSTALL_HINT)
    # One row per fault: a plugin that failed as a whole, or each backend it handed back
    # that was refused (malformed, reserved or taken name).
    failed = [(r.name, r.distribution, r.version, fault) for r in registry.records for fault in r.faults]
    if failed:
        print("\nplugins that failed to load (or backends they provided that were refused)")
        print(_table(("entry point", "distribution", "version", "error"), failed))
    forced = registry.forced()
    if forced:
        print(f"\nforced backend(s): {', '.join(forced)} ({BACKEND_ENV_VARIABLE} or use_backend)")
        for name in forced:
            if registry.get(name) is None:
                installed = ", ".join(b.name for b in registry.backends) or "none"
                print(f"forced backend '{name}' is not installed (installed: {installed}); "
                      f"calls will find no backend until {BACKEND_ENV_VARIABLE} names one that is")
    backends = registry.backends
    print("\nop x backend (each op's first bench case at [1, 7168] bf16, else its first case, "
          "on the backend's own device type)")
    matrix = []
    for opdef in opdefs.all_ops():
        line: list[str] = [opdef.name]
        try:
            _, label = representative_call(opdef, "cpu", _host_traits())
        except Exception as error:  # noqa: BLE001 - report, never crash info
            label = f"no call ({type(error).__name__}: {_one_line(error, 80)})"
        for backend in backends:
            kernel = backend.kernels.get(opdef.kernel)
            if kernel is None:
                line.append("-")
                continue
            device_type = _own_device_type(backend)
            try:
                call, _ = representative_call(opdef, device_type, backend.traits_for(device_type))
            except Exception as error:  # noqa: BLE001 - report, never crash info
                line.append(f"no call ({type(error).__name__}: {_one_line(error, 80)})")
                continue
            try:
                why = kernel.supports(call)
            except Exception as error:  # noqa: BLE001 - report, never crash info
                why = f"supports() raised {type(error).__name__}"
            line.append("yes" if why is None else f"no ({why})")
        line.append(label)
        matrix.append(line)
    print(_table(("op",) + tuple(b.name for b in backends) + ("call asked about",), matrix))
    for backend in backends:
        if backend.capabilities is not None:
            try:
                text = backend.capabilities()
            except Exception as error:  # noqa: BLE001 - report, never crash info
                text = f"capabilities() raised {type(error).__name__}: {error}"
            print(f"\n{backend.name}: {text}")
    print("\n'-' = no kernel for the op; unavailable backends are shown with what they would accept.")
    if not backends:
        print(INSTALL_HINT)
    return 0


def _host_traits() -> Any:
    from tileplug.core import config

    return config.current().host_layout


# ---------------------------------------------------------------------- demo


def _returns_pair(opdef) -> bool:
    """Whether the op returns two tensors (its custom-op schema, derived from the signature, says)."""
    return opdef.schema.endswith("-> (Tensor, Tensor)")


def _quantizes_a_plain_tensor(opdef) -> bool:
    """Whether the op's first argument may be a plain tensor (its schema's scales half of a
    tensor-or-pair ``x`` is optional); an op whose ``x`` must be a quantized pair is not a
    quantization of the demo's activation."""
    return not opdef.schema.startswith("(Tensor x, Tensor x_scales")


def demo_cases() -> list:
    """Bench cases of every op of the inverse's family that quantizes a plain tensor into a
    ``(q, sf)`` pair."""
    from tileplug.core import opdefs

    if DEMO_INVERSE not in opdefs.names():
        return []
    family = opdefs.get(DEMO_INVERSE).family
    return [case for opdef in opdefs.all_ops()
            if opdef.family == family and _returns_pair(opdef) and _quantizes_a_plain_tensor(opdef)
            for case in opdef.bench()]


def command_demo(args: argparse.Namespace) -> int:
    from tileplug.core import opdefs
    from tileplug.core.benchmark import median_seconds
    from tileplug.core.errors import TileplugError
    from tileplug.core.opdefs import describe_call
    from tileplug.core.ops.quant import block_of
    from tileplug.core.registry import registry
    from tileplug.core.testing import relative_error

    device = _device(args.device)
    tokens, hidden = args.tokens, args.hidden
    cases = demo_cases()
    print(f"\ndemo: quantize a [{tokens}, {hidden}] bf16 activation (with outlier channels) on {device.type}")
    if not registry.backends:
        print(INSTALL_HINT)
    inverse = opdefs.get(DEMO_INVERSE) if cases else None
    rows = []
    for case in cases:
        opdef = opdefs.get(case.op)
        kwargs = dict(case.kwargs)
        try:
            op_args, op_kwargs = case.arguments(tokens, hidden, torch.bfloat16, device)
            call, _ = describe_call(case.op, *op_args, **op_kwargs)
            backend, _ = registry.select(call.op, call)
        except TileplugError as error:
            rows.append((case.name, "none", "", "", "", "", "", "", _one_line(error, 160)))
            continue
        x = op_args[0]
        note = ""
        try:
            q, sf = opdef.function(*op_args, **op_kwargs)
            seconds = median_seconds(lambda: opdef.function(*op_args, **op_kwargs), device)
        except TileplugError as error:
            rows.append((case.name, backend.name, "", "", "", "", "", "", _one_line(error, 160)))
            continue
        ledger = opdef.ledger(call, backend.traits_for(call.device_type))
        error_text = back_gbps = ""
        block = block_of(case.op, kwargs)
        try:
            restored = inverse.function((q, sf), "fp32", x_block_size=block)
            error_text = f"{relative_error(restored, x.float()):.4f}"
            back_call, _ = describe_call(DEMO_INVERSE, (q, sf), "bf16", x_block_size=block)
            back_backend, _ = registry.select(back_call.op, back_call)
            back_seconds = median_seconds(lambda: inverse.function((q, sf), "bf16", x_block_size=block), device)
            back_bytes = inverse.ledger(back_call, back_backend.traits_for(device.type)).bytes_total
            back_gbps = f"{back_bytes / back_seconds / 1e9:.2f}"
        except TileplugError as error:
            error_text = back_gbps = "n/a"
            note = f"{DEMO_INVERSE}: {_one_line(error, 160)}"
        rows.append((
            case.name, backend.name, f"{tuple(q.shape)} {str(q.dtype).replace('torch.', '')}",
            f"{tuple(sf.shape)} {str(sf.dtype).replace('torch.', '')}", error_text,
            f"{seconds * 1e6:.0f}", f"{ledger.bytes_total / seconds / 1e9:.2f}", back_gbps, note,
        ))
    print(_table(("op", "backend", "q", "sf", "round-trip rel err", "us", "GB/s", f"{DEMO_INVERSE} GB/s", "note"),
                 rows))
    print(f"round-trip rel err = ||{DEMO_INVERSE}(q, sf) - x|| / ||x||; GB/s = ledger bytes / median time")
    demo_qk_step(device, tokens)
    demo_moe_step(device, tokens)
    return 0


def demo_qk_step(device: torch.device, tokens: int) -> None:
    """The query path of an attention block: per-head RMSNorm, RoPE and the per-token FP8 cast
    of ``[T, 32 heads, 128]`` bf16, fused in one op and as the chain of three ops it fuses:
    same bytes, and the bytes each moves."""
    from tileplug.core import opdefs
    from tileplug.core.benchmark import median_seconds
    from tileplug.core.errors import TileplugError
    from tileplug.core.opdefs import describe_call
    from tileplug.core.registry import registry
    from tileplug.core.testing import activation, bytes_equal

    fused_name, chain_names = DEMO_QK_STEP
    if not all(name in opdefs.names() for name in (fused_name, *chain_names)):
        return
    fused, norm, rotary, cast = (opdefs.get(name) for name in (fused_name, *chain_names))
    heads, head_dim = DEMO_HEADS, DEMO_HEAD_DIM
    x = activation(tokens, heads * head_dim, device=device, seed=1).view(tokens, heads, head_dim)
    generator = torch.Generator().manual_seed(2)
    weight = (1.0 + 0.1 * torch.randn(head_dim, generator=generator)).to(torch.bfloat16).to(device)
    inverse_frequency = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max(tokens, 1), dtype=torch.float64)[:, None] * inverse_frequency[None, :]
    cache = torch.cat([angles.cos(), angles.sin()], dim=1).to(torch.float32).to(device)
    positions = torch.arange(tokens, dtype=torch.int64, device=device)

    def chain() -> tuple:
        y = norm.function(x, weight)
        rotary.function(y, cache, positions=positions)
        return cast.function(y.view(tokens, heads * head_dim), "e4m3", head_dim)

    def one_pass() -> tuple:
        return fused.function(x, weight, cache, positions, num_per_channels=head_dim)

    print(f"\nattention step: QK-norm + RoPE (NeoX) + per-token e4m3 cast of [{tokens}, {heads}, {head_dim}] bf16 "
          f"on {device.type}")
    try:
        calls = [describe_call(fused_name, x, weight, cache, positions, num_per_channels=head_dim)[0],
                 describe_call(chain_names[0], x, weight)[0],
                 describe_call(chain_names[1], x, cache, positions=positions)[0],
                 describe_call(chain_names[2], x.view(tokens, heads * head_dim), "e4m3", head_dim)[0]]
        backends = [registry.select(call.op, call)[0] for call in calls]
        ledgers = [opdefs.get(call.name).ledger(call, backend.traits_for(device.type)).bytes_total
                   for call, backend in zip(calls, backends)]
        q, sf = one_pass()
        q_chain, sf_chain = chain()
        same = bytes_equal(q, q_chain) and bytes_equal(sf, sf_chain)
        fused_seconds = median_seconds(one_pass, device)
        chain_seconds = median_seconds(chain, device)
    except TileplugError as error:
        print(f"  not run: {_one_line(error, 160)}")
        return
    chain_bytes = sum(ledgers[1:])
    rows = [
        (fused_name, backends[0].name, f"{ledgers[0] / 1e6:.2f}", f"{fused_seconds * 1e6:.0f}",
         f"{ledgers[0] / fused_seconds / 1e9:.2f}"),
        (" -> ".join(chain_names), "/".join(dict.fromkeys(b.name for b in backends[1:])), f"{chain_bytes / 1e6:.2f}",
         f"{chain_seconds * 1e6:.0f}", f"{chain_bytes / chain_seconds / 1e9:.2f}"),
    ]
    print(_table(("path", "backend", "ledger MB", "us", "GB/s"), rows))
    print(f"fused == chain bytewise: {'yes' if same else 'NO'}; bytes saved by fusing: "
          f"{chain_bytes / ledgers[0]:.2f}x; time: {chain_seconds / fused_seconds:.2f}x")


def demo_moe_step(device: torch.device, tokens: int) -> None:
    """An MoE layer of ``tokens`` tokens: ``DEMO_ROUTER``'s routing of fp32 logits, the counts
    and the expanded layout (rows of an expert aligned to ``DEMO_ALIGNMENT``), the permuted
    bf16 rows, each expert's SwiGLU MLP in torch (no SwiGLU op is declared yet), and the
    weighted unpermute — the time of each routing op, and the layer against a token-by-token
    torch loop over the same routing."""
    from tileplug.core import opdefs
    from tileplug.core.benchmark import median_seconds
    from tileplug.core.errors import TileplugError
    from tileplug.core.opdefs import describe_call
    from tileplug.core.registry import registry
    from tileplug.core.testing import relative_error

    if not all(name in opdefs.names() for name in DEMO_MOE_STEP):
        return
    gate, counts_op, permute, unpermute = (opdefs.get(name) for name in DEMO_MOE_STEP)
    router = dict(DEMO_ROUTER)
    experts, topk = router.pop("num_experts"), router.pop("num_topk")
    hidden, intermediate = DEMO_EXPERT_HIDDEN, DEMO_EXPERT_INTERMEDIATE
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(tokens, experts, generator=generator).to(device)
    bias = (0.1 * torch.randn(experts, generator=generator)).to(device)
    x = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16).to(device)
    up = (torch.randn(experts, hidden, 2 * intermediate, generator=generator) / hidden ** 0.5).to(torch.bfloat16)
    down = (torch.randn(experts, intermediate, hidden, generator=generator) / intermediate ** 0.5).to(torch.bfloat16)
    up, down = up.to(device), down.to(device)

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = (rows @ up[expert]).float()
        activated = torch.nn.functional.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        return (activated.to(torch.bfloat16) @ down[expert])

    # the experts' activation through the op table where it is declared (padding rows stay zero)
    swiglu = opdefs.get("swiglu") if "swiglu" in opdefs.names() else None

    print(f"\nMoE step: route [{tokens}, {experts}] fp32 logits (top-{topk}, {router['num_groups']} groups, best "
          f"{router['topk_groups']}, {router['scoring']} + bias, x{router['routed_scaling_factor']}), permute "
          f"[{tokens}, {hidden}] bf16, experts in torch{' with swiglu' if swiglu is not None else ''}, unpermute, "
          f"on {device.type}")
    try:
        topk_idx, topk_weights = gate.function(logits, topk, bias=bias, **router)
        counts, expert_ends = counts_op.function(topk_idx, experts, alignment=DEMO_ALIGNMENT)
        x_expanded, _, permutation, _ = permute.function(x, topk_idx, experts, alignment=DEMO_ALIGNMENT)
        y_expanded = torch.zeros_like(x_expanded)
        ends = expert_ends.tolist()
        busy_experts = [(expert, ends[expert] - count, ends[expert]) for expert, count in enumerate(counts.tolist())
                        if count]
        timed = [
            (gate, (logits, topk), {"bias": bias, **router}),
            (counts_op, (topk_idx, experts), {"alignment": DEMO_ALIGNMENT}),
            (permute, (x, topk_idx, experts), {"alignment": DEMO_ALIGNMENT}),
        ]
        if swiglu is None:
            for expert, start, end in busy_experts:
                y_expanded[start:end] = expert_mlp(expert, x_expanded[start:end])
        else:
            gate_up = torch.zeros(x_expanded.shape[0], 2 * intermediate, dtype=torch.bfloat16, device=device)
            for expert, start, end in busy_experts:
                gate_up[start:end] = x_expanded[start:end] @ up[expert]
            swiglu_kwargs = {"expert_ends": expert_ends, "expert_alignment": DEMO_ALIGNMENT}
            activated = swiglu.function(gate_up, **swiglu_kwargs)
            for expert, start, end in busy_experts:
                y_expanded[start:end] = activated[start:end] @ down[expert]
            timed.append((swiglu, (gate_up,), swiglu_kwargs))
        y = unpermute.function(y_expanded, permutation, topk_weights, tokens)
        timed.append((unpermute, (y_expanded, permutation, topk_weights, tokens), {}))
        rows = []
        for opdef, op_args, op_kwargs in timed:
            call, _ = describe_call(opdef.name, *op_args, **op_kwargs)
            backend, _ = registry.select(call.op, call)
            seconds = median_seconds(lambda: opdef.function(*op_args, **op_kwargs), device)
            ledger = opdef.ledger(call, backend.traits_for(device.type)).bytes_total
            rows.append((opdef.name, backend.name, f"{ledger / 1e6:.3f}", f"{seconds * 1e6:.0f}",
                         f"{ledger / seconds / 1e9:.2f}"))
    except TileplugError as error:
        print(f"  not run: {_one_line(error, 160)}")
        return
    expected = torch.zeros(tokens, hidden, dtype=torch.float32, device=device)
    for token in range(tokens):
        for slot in range(topk):
            expert = int(topk_idx[token, slot])
            if 0 <= expert < experts:
                expected[token] += float(topk_weights[token, slot]) * expert_mlp(expert, x[token:token + 1])[0].float()
    print(_table(("op", "backend", "ledger MB", "us", "GB/s"), rows))
    busy = int((counts > 0).sum())
    print(f"{busy} of {experts} experts received tokens; layer vs a token-by-token torch loop: rel err "
          f"{relative_error(y.float(), expected):.2e} (one bf16 rounding of the sum)")


# ---------------------------------------------------------------------- bench


def command_bench(args: argparse.Namespace) -> int:
    from tileplug.core import benchmark
    from tileplug.core.registry import registry

    device = _device(args.device)
    cases = benchmark.bench_cases()
    chosen = args.ops or list(cases)
    unknown = [name for name in chosen if name not in cases]
    if unknown:
        raise UsageError(f"unknown op case(s): {', '.join(unknown)}; bench cases: {', '.join(cases)}")
    dispatch_cases = args.dispatch_cases or []
    unknown = [name for name in dispatch_cases if name not in cases]
    if unknown:
        raise UsageError(f"unknown dispatch case(s): {', '.join(unknown)}; bench cases: {', '.join(cases)}")
    tokens_list = args.tokens
    peers = args.peer or []
    unknown = [name for name in peers if name not in benchmark.PEERS]
    if unknown:
        raise UsageError(f"unknown peer(s): {', '.join(unknown)}; known peers: {', '.join(benchmark.PEERS)}")
    if args.plot:
        _require_matplotlib()
    if args.backends:
        for name in args.backends:
            _backend(name)
        backends = list(args.backends)
    else:
        backends = [b.name for b in registry.backends if b.serves(device.type) and b.unavailable_reason() is None]
    dtype = DTYPES[args.dtype]
    with_compile = not args.no_compile
    if args.dry_run:
        return _bench_dry_run(args, device, [cases[n] for n in chosen], tokens_list, dtype, backends, dispatch_cases)
    log = (lambda text: print(text, file=sys.stderr)) if args.verbose else (lambda text: None)
    if device.type == "cuda" and device.index is not None:
        # tileplug's ops launch on their tensors' device whatever is current, but the peers
        # (Triton kernels, torch.compile) launch on the current device: make it the timed one
        torch.cuda.set_device(device)
    report = benchmark.BenchReport(str(device), benchmark.device_name(device), benchmark.copy_bandwidth(device),
                                   torch.__version__)
    if with_compile:
        # The peer gets a fresh dynamo cache per op case and room to specialise on every
        # size; should it still hit the limit, it raises (reported as "did not compile")
        # instead of silently timing eager PyTorch.
        import torch._dynamo as dynamo

        dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 4 * len(tokens_list))
        dynamo.config.fail_on_recompile_limit_hit = True
    for name in chosen:
        if with_compile:
            dynamo.reset()
        for tokens in tokens_list:
            report.rows.extend(
                benchmark.measure_case(
                    cases[name], tokens, args.hidden, dtype, device, backends, report.copy_gbps,
                    with_compile=with_compile, with_host_time=tokens in (1,), log=log,
                    peers=peers, with_graph=not args.no_graph,
                )
            )
    if not args.no_dispatch and dispatch_cases:
        report.dispatch = benchmark.dispatch_cost(device, args.hidden, dispatch_cases)
    print(f"device: {report.device} ({report.device_name}); copy ceiling {report.copy_gbps:.1f} GB/s; "
          f"torch {report.torch_version}")
    rows = [
        (
            r.case, r.tokens, r.hidden, r.runner,
            "" if r.median_us is None else f"{r.median_us:.1f}",
            "" if r.gbps is None else f"{r.gbps:.2f}",
            "" if r.pct_of_copy is None else f"{r.pct_of_copy:.1f}%",
            "" if r.host_us is None else f"{r.host_us:.1f}",
            "" if r.graph_us is None else f"{r.graph_us:.2f}",
            "" if r.graph_gbps is None else f"{r.graph_gbps:.2f}",
            r.note,
        )
        for r in report.rows
    ]
    print(_table(("op", "T", "H", "runner", "median us", "GB/s", "% of copy", "host us/call", "graph us",
                  "graph GB/s", "note"), rows))
    # Peers are compared with the backend a user's call would get (the highest priority timed).
    timed = [b for b in registry.backends if b.name in backends and b.serves(device.type)]
    ours = max(timed, key=lambda b: b.priority).name if timed else None
    for peer in peers:
        ratios = benchmark.peer_ratios(report.rows, peer, ours) if ours else []
        if ratios:
            print(f"\n{peer} time / {ours} time (> 1: {ours} is faster)")
            print(_table(("op", "T", "eager", "graph", "host"), [
                (r["case"], r["tokens"], *("" if r[k] is None else f"{r[k]:.2f}" for k in ("eager", "graph", "host")))
                for r in ratios]))
    for name, d in report.dispatch.items():
        if "note" in d:
            print(f"\ndispatch cost, {name} [1, {args.hidden}] on {device.type}: {d['note']}")
            continue
        print(
            f"\ndispatch cost, {name} [1, {args.hidden}] on {device.type} via '{d['backend']}': "
            f"core.ops call {d['core_call_us']:.1f} us; kernel called directly {d['direct_kernel_us']:.1f} us "
            f"(preallocated outputs), {d['direct_kernel_fresh_outputs_us']:.1f} us (fresh outputs from the plan); "
            f"dispatch overhead {d['dispatch_overhead_us']:.1f} us (contract check alone {d['contract_check_us']:.1f} us)"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report.as_dict(), handle, indent=2)
        print(f"\nwrote {args.json}")
    if args.plot:
        benchmark.plot_report(report.as_dict(), args.plot)
        print(f"wrote {args.plot}")
    return 0


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'tileplug-core[plot]'") from None


def command_plot(args: argparse.Namespace) -> int:
    from tileplug.core import benchmark

    _require_matplotlib()
    try:
        with open(args.report) as handle:
            report = json.load(handle)
    except (OSError, ValueError) as error:
        raise UsageError(f"report: cannot read {args.report}: {error}") from None
    benchmark.plot_report(report, args.output)
    print(f"wrote {args.output}")
    return 0


def _bench_dry_run(args: argparse.Namespace, device: torch.device, cases: list, tokens_list: list[int],
                   dtype: torch.dtype, backends: list[str], dispatch_cases: list[str]) -> int:
    from tileplug.core import benchmark

    rows = []
    for case in cases:
        for tokens in tokens_list:
            for entry in benchmark.plan_case(case, tokens, args.hidden, dtype, device, backends,
                                             with_compile=not args.no_compile):
                rows.append((entry.case, case.op, entry.tokens, entry.hidden, entry.runner,
                             entry.ledger_bytes or "", entry.note))
    print(f"dry run on {device.type}: {len(cases)} case(s) x {len(tokens_list)} token count(s); nothing is timed")
    print(_table(("op", "declared op", "T", "H", "runner", "ledger bytes", "note"), rows))
    if dispatch_cases and not args.no_dispatch:
        print(f"\ndispatch cost would be measured for {', '.join(dispatch_cases)} at [1, {args.hidden}]")
    return 0


# ---------------------------------------------------------------------- precompile


def command_precompile(args: argparse.Namespace) -> int:
    from tileplug.core import precompile
    from tileplug.core.registry import registry

    # Only the device *type* matters (calls are described on meta): an image can be warmed
    # for CUDA on a machine without a GPU with --device cuda --backends cuda.
    try:
        device = torch.device(args.device) if args.device else _default_device()
    except RuntimeError as error:
        raise UsageError(f"--device: {error}") from None
    ops = args.ops or None
    for name in ops or []:
        _opdef(name)
    if args.backends:
        chosen = [_backend(name) for name in args.backends]
    else:
        chosen = [b for b in registry.backends
                  if b.serves(device.type) and b.precompile is not None and b.unavailable_reason() is None]
    if not chosen:
        why = [f"{b.name}: {b.unavailable_reason()}" for b in registry.backends
               if b.serves(device.type) and b.precompile is not None and b.unavailable_reason() is not None]
        print(f"no available backend for {device.type} compiles ahead of time; nothing to do"
              + (f" ({'; '.join(why)}; name one with --backends to build for it anyway)" if why else ""))
        return 0
    for backend in chosen:
        report = precompile.precompile(backend, device.type, ops, args.workers, args.hidden)
        print(f"{backend.name}: {report.calls} calls of the op table's grid; compiled {report.compiled} "
              f"kernel(s) the cache lacked in {report.seconds:.1f} s")
    return 0


# ---------------------------------------------------------------------- lower, ledger


def command_lower(args: argparse.Namespace) -> int:
    backend = _backend(args.backend)
    device_type = _own_device_type(backend)
    traits = backend.traits_for(device_type)
    opdef, call, _, _ = _command_call(args, traits)
    call = dataclasses.replace(call, device_type=device_type)
    from tileplug.core.lowering import LoweringError, lower_call

    try:
        source = lower_call(backend, call)
    except LoweringError as error:  # what the user asked for cannot be lowered: a usage error
        raise UsageError(str(error)) from None
    print(source)
    return 0


def command_ledger(args: argparse.Namespace) -> int:
    from tileplug.core.quant.layouts import LAYOUTS

    traits = LAYOUTS[args.layout]
    opdef, call, kwargs, inputs = _command_call(args, traits)
    ledger = opdef.ledger(call, traits)
    report = {"op": opdef.name, "tokens": args.tokens, "hidden": args.hidden, "dtype": args.dtype,
              "layout": args.layout, "options": {k: _jsonable(v) for k, v in kwargs.items()},
              "inputs": {k: _jsonable(v) for k, v in inputs.items()}, **ledger._asdict(),
              "bytes_total": ledger.bytes_total}
    if opdef.unfused is not None:
        steps = opdef.unfused(call, traits)
        unfused_total = sum(step.bytes_total for _, step in steps)
        report["unfused"] = {
            "steps": [{"step": name, **step._asdict(), "bytes_total": step.bytes_total} for name, step in steps],
            "bytes_total": unfused_total,
            "ratio": round(unfused_total / ledger.bytes_total, 4) if ledger.bytes_total else None,
        }
    print(json.dumps(report, indent=2))
    return 0


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# ---------------------------------------------------------------------- parser, main


def build_parser() -> argparse.ArgumentParser:
    from tileplug.core.quant.layouts import LAYOUTS

    parser = _Parser(prog="tileplug", description="tileplug: pluggable memory-bound LLM kernels", epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", required=True,
                                     metavar="{info,demo,bench,plot,precompile,lower,ledger}")

    commands.add_parser("info", help="installed backends, availability and the op x backend matrix")

    demo = commands.add_parser("demo", help="quantize a realistic activation with each cast, round-trip error, GB/s")
    demo.add_argument("--device", help="cpu, cuda, npu (default: the best available)")
    demo.add_argument("--tokens", type=_count, default=512)
    demo.add_argument("--hidden", type=_positive, default=7168)

    bench = commands.add_parser("bench", help="every op's bench cases x sizes on every available backend")
    bench.add_argument("--device", help="cpu, cuda, cuda:1, npu (default: the best available)")
    bench.add_argument("--ops", type=_names, help="comma-separated bench case names (default: all)")
    bench.add_argument("--tokens", type=_counts, default=[1, 16, 128, 1024], help="comma-separated token counts")
    bench.add_argument("--hidden", type=_positive, default=7168)
    bench.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    bench.add_argument("--backends", type=_names,
                       help="comma-separated backend names (default: all available for the device)")
    bench.add_argument("--no-compile", action="store_true", help="skip the torch.compile(reference) peer")
    bench.add_argument("--no-dispatch", action="store_true", help="skip the dispatch-cost measurement")
    bench.add_argument("--dispatch-cases", type=_names, default=_names(DEFAULT_DISPATCH_CASES),
                       help=f"bench cases whose dispatch cost is measured at T=1 (default: {DEFAULT_DISPATCH_CASES})")
    bench.add_argument("--dry-run", action="store_true",
                       help="list the cases x token counts x runners (with ledger bytes) without timing anything")
    bench.add_argument("--json", help="also write the report as JSON to this path")
    bench.add_argument("--peer", type=_names, help="comma-separated peer libraries timed beside tileplug in the same "
                                                   "process, where importable (known: " + ", ".join(_peer_names()) + ")")
    bench.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay column (CUDA only)")
    bench.add_argument("--plot", metavar="FILE.png", help="draw GB/s against T per runner with the copy line "
                                                          "(needs matplotlib: tileplug-core[plot])")
    bench.add_argument("--verbose", action="store_true", help="log progress to stderr")

    plot = commands.add_parser("plot", help="draw a saved bench report (bench --json) as GB/s against T")
    plot.add_argument("report", help="a JSON report written by tileplug bench --json")
    plot.add_argument("-o", "--output", required=True, metavar="FILE.png")

    pre = commands.add_parser("precompile", help="compile ahead of time the kernels of every op's case and bench grid")
    pre.add_argument("--device", help="cpu, cuda, npu (default: the best available)")
    pre.add_argument("--ops", type=_names, help="comma-separated declared ops (default: all)")
    pre.add_argument("--backends", type=_names, help="comma-separated backend names (default: every available "
                                                      "backend of the device that compiles ahead of time)")
    pre.add_argument("--workers", type=_positive, help="parallel compile processes (default: the host's cores)")
    pre.add_argument("--hidden", type=_positive, default=7168, help="H of the bench cases' calls")

    for name, helptext in (("lower", "generated device source of one specialisation"),
                           ("ledger", "bytes and flops one call must move")):
        sub = commands.add_parser(name, help=helptext)
        sub.add_argument("op", help="a declared op (tileplug info lists them)")
        sub.add_argument("--tokens", type=_count, default=1)
        sub.add_argument("--hidden", type=_positive, default=7168)
        sub.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
        sub.add_argument("--option", "-o", action="append", type=_key_value, metavar="KEY=VALUE",
                         help="op keyword argument, JSON when it parses: -o fmt=e2m1 -o round_sf=true "
                              "-o block_size=[32,32]")
        sub.add_argument("--input", "-i", action="append", type=_key_value, metavar="KEY=VALUE",
                         help="input option, e.g. -i input_sf=ue8m0 -i input_fmt=e2m1 -i row_stride_pad=8")
        if name == "lower":
            sub.add_argument("--backend", required=True)
        else:
            sub.add_argument("--layout", choices=sorted(LAYOUTS), default="cuda")
    return parser


HANDLERS = {
    "info": command_info,
    "demo": command_demo,
    "bench": command_bench,
    "precompile": command_precompile,
    "plot": command_plot,
    "lower": command_lower,
    "ledger": command_ledger,
}


def _run(argv: Sequence[str] | None) -> int:
    from tileplug.core.errors import BackendError, TileplugError

    command = "tileplug"
    try:
        args = build_parser().parse_args(argv)
        command = f"tileplug {args.command}"
        return HANDLERS[args.command](args)
    except UsageError as error:
        text = _one_line(error, 2000)
        print(text if text.startswith("tileplug") else f"{command}: {text}", file=sys.stderr)
        return 2
    except BackendError as error:
        print(f"{command}: {_one_line(error, 2000)}", file=sys.stderr)
        return 1
    except TileplugError as error:  # contract errors, no backend for the call as asked
        print(f"{command}: {_one_line(error, 2000)}", file=sys.stderr)
        return 2
    except (BrokenPipeError, KeyboardInterrupt):
        raise
    except Exception as error:  # noqa: BLE001 - one line, the traceback only on request
        if os.environ.get("TILEPLUG_DEBUG"):
            raise
        print(f"{command}: internal error: {type(error).__name__}: {_one_line(error, 1000)} "
              f"(TILEPLUG_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            status = _run(argv)
        except SystemExit as exit_:  # --help, --version
            status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        # The reader went away (tileplug info | head -1): say nothing more. Python's recipe:
        # point stdout at devnull so the interpreter's final flush does not fail again.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 141
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
