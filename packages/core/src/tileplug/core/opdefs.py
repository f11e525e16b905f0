"""The op table: every op declared once, with the seven facts everything else derives from.

An :class:`OpDef` holds an op's public function (signature), its contract (arguments →
``(Call, inputs)``), outputs (``Call`` + layout traits → allocation plan), result (written
outputs → what the function returns), ledger (bytes and flops), cases (its test grid) and
bench configurations. ``declare`` adds one to the table and registers it as the
``torch.library`` custom op ``torch.ops.tileplug.<name>`` with a fake implementation, so
``torch.compile(fullgraph=True)`` sees one opaque node and shapes propagate on meta and
fake tensors. The CLI (``info``, ``lower``, ``ledger``, ``bench``, ``demo``), the
conformance suite and the compile / lowering / GPU test grids read the table; none of
them names an op.

Eager calls take the short path (:func:`run`): contract → cached route → allocation →
launch. Under ``torch.compiler.is_compiling()`` the public function calls
:meth:`OpDef.traced`, which goes through ``torch.ops.tileplug.<name>``.
"""

from __future__ import annotations

import inspect
import threading
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tileplug.core.contracts.checks import describe
from tileplug.core.errors import BackendError, ContractError
from tileplug.core.registry import registry  # (imported here, not in run: a local import costs 0.6 µs a call)

LIBRARY_NAMESPACE = "tileplug"


# ---------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One configuration of an op's test grid, independent of the token count.

    ``op``: public op name; ``hidden``: H; ``dtype``: input dtype; ``kwargs``: the op's
    keyword arguments; ``inputs``: how the op's family makes the input tensors beyond
    ``[T, H]`` of ``dtype`` (e.g. the sf encoding of a quantized input, a padded row
    stride). Both are tuples of ``(name, value)`` pairs so that a case hashes.
    """

    op: str
    hidden: int
    dtype: torch.dtype = torch.bfloat16
    kwargs: tuple[tuple[str, Any], ...] = ()
    inputs: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, op: str, hidden: int, dtype: torch.dtype = torch.bfloat16, inputs: Mapping[str, Any] | None = None,
           **kwargs: Any) -> Case:
        """``Case.of("per_token_cast", 576, fmt="e2m1")``: kwargs are the op's keyword arguments."""
        return cls(op, hidden, dtype, tuple(sorted(kwargs.items())), tuple(sorted((inputs or {}).items())))

    @property
    def id(self) -> str:
        parts = [f"H={self.hidden}", str(self.dtype).replace("torch.", "")]
        parts += [f"{k}={_short(v)}" for k, v in self.inputs]
        parts += [f"{k}={_short(v)}" for k, v in self.kwargs]
        return f"{self.op}[{','.join(parts)}]"

    def arguments(self, tokens: int, device: str | torch.device = "cpu", seed: int | None = None) -> tuple[tuple, dict]:
        """(args, kwargs) of this case at ``tokens`` on ``device`` (meta: shapes only)."""
        return get(self.op).arguments(tokens, self.hidden, self.dtype, dict(self.kwargs), dict(self.inputs),
                                      torch.device(device), self.hidden * 7 + tokens if seed is None else seed)


def _short(value: Any) -> str:
    if isinstance(value, tuple):
        return "x".join(str(v) for v in value)
    return str(value)


def checked_case_inputs(op: str, inputs: Mapping[str, Any], options: Mapping[str, str],
                        choices: Mapping[str, tuple], minimum: Mapping[str, int] | None = None,
                        default_minimum: int = 0) -> None:
    """Check a case's ``inputs`` (how a family's cases make their tensors) against the family's
    ``options`` (name → description, the text before ``:`` naming what is expected): a name
    in ``choices`` takes one of its values (of the same type), any other an int of at least
    ``minimum.get(name, default_minimum)``. Raises ``ContractError`` naming ``inputs.<name>``."""
    for key, value in inputs.items():
        if key not in options:
            raise ContractError(op, f"inputs.{key}", f"one of {', '.join(options)}", key)
        allowed = choices.get(key)
        if allowed is not None:
            if value not in allowed or type(value) is not type(allowed[0]):
                raise ContractError(op, f"inputs.{key}", f"one of {', '.join(map(repr, allowed))}", repr(value))
        elif type(value) is not int or value < (minimum or {}).get(key, default_minimum):
            raise ContractError(op, f"inputs.{key}", options[key].split(":")[0], repr(value))


@dataclass(frozen=True)
class BenchCase:
    """One configuration ``tileplug bench`` times: ``name`` (unique, comma-free), the op, and
    its keyword arguments / input options as in :class:`Case`."""

    name: str
    op: str
    kwargs: tuple[tuple[str, Any], ...] = ()
    inputs: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, name: str, op: str, inputs: Mapping[str, Any] | None = None, **kwargs: Any) -> BenchCase:
        return cls(name, op, tuple(sorted(kwargs.items())), tuple(sorted((inputs or {}).items())))

    def arguments(self, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device,
                  seed: int | None = None) -> tuple[tuple, dict]:
        return get(self.op).arguments(tokens, hidden, dtype, dict(self.kwargs), dict(self.inputs), device,
                                      tokens if seed is None else seed)


# ---------------------------------------------------------------------- the declaration


@dataclass(eq=False)
class OpDef:
    """One op's declaration (see the module docstring).

    - ``function``: the public function; its signature and type hints give the custom op's
      schema (``out`` is eager-only and not part of it).
    - ``contract(*args, **kwargs)`` → ``(call, inputs)``: every check, ContractError naming
      the argument; ``inputs`` is a sequence of the tensors the kernel reads.
    - ``outputs(call, traits)`` → a plan with ``allocate(tokens, device)`` (the output tensors
      a kernel writes, a NamedTuple with None for absent outputs).
    - ``result(call, outputs)`` → what the function returns.
    - ``ledger(call, traits)`` → :class:`tileplug.core.call.Ledger`.
    - ``cases()`` → the op's :class:`Case` grid; ``bench()`` → its :class:`BenchCase` list.
    - ``arguments(tokens, hidden, dtype, kwargs, inputs, device, seed)`` → (args, kwargs) of a
      call with those options (values from ``tileplug.core.testing.activation``; meta: shapes).
    - ``compare(case, tokens, actual, expected)``: asserts a backend's outputs equal the
      reference's as SPEC says (default: bytewise, strides included).
    - ``input_options``: the names ``arguments`` accepts in ``inputs``, each with a one-line
      description (``tileplug lower/ledger -i``); an unknown one is a ContractError.
    - ``kernel``: the backend kernel-table key (default ``name``); ``family``: e.g. "quant".
    - ``written``: keyword arguments that are output tensors the caller passes to be written
      in place (and that the contract checks itself, aliasing an input where the op allows
      it, e.g. a norm's ``out=x``), each with the index of the result element it holds.
      They are not part of the custom op's schema: eager, the kernel writes them; under
      ``torch.compile`` the op's fresh result is copied into them (a functionalized input
      mutation). ``out`` not named here stays eager-only and is refused under compile.
    - ``autograd``: ``(setup_context, backward)`` registered with
      ``torch.library.register_autograd`` on the custom op, over its flat schema inputs and
      outputs (a differentiable op: its inputs are not detached, and the public function
      goes through :meth:`traced` whenever :func:`wants_grad` says a graph is recorded).
    - ``mutates``: the tensor parameters an in-place op writes (its function returns None,
      its plan allocates nothing, its kernels write those inputs, which the contract's
      inputs hold under the same names); the custom op declares them mutated
      (``Tensor(a!)`` in the schema), so ``torch.compile`` functionalizes them.
      :meth:`produced` gives them back as the call's outputs.
    - ``advances``: the generator parameter (``Generator | None``) whose offset the op's
      kernels advance by one when they draw (a stochastic quant cast; not for an empty
      input): the backend advances it, on the device, in the draw's own launch where it can.
      The schema marks that generator's offset tensor mutated (``Tensor(a!)?``), so
      ``torch.compile`` functionalizes the advance; :meth:`produced` appends the offset
      tensor to the outputs when a generator is given (the conformance suite compares it).
    - ``unfused(call, traits)`` → ``[(step, Ledger)]``: the op's bytes without fusion (its
      eager PyTorch decomposition, or the chain of this library's ops a fused op replaces;
      ``tileplug.core.unfused``); None: the op has no unfused form.
    """

    name: str
    function: Callable[..., Any]
    contract: Callable[..., tuple[Any, Sequence[torch.Tensor | None]]]
    outputs: Callable[[Any, Any], Any]
    result: Callable[[Any, Any], Any]
    ledger: Callable[[Any, Any], Any]
    cases: Callable[[], Sequence[Case]]
    bench: Callable[[], Sequence[BenchCase]]
    arguments: Callable[..., tuple[tuple, dict]]
    compare: Callable[[Case, int, list, list], None] | None = None
    input_options: Mapping[str, str] = field(default_factory=dict)
    kernel: str = ""
    family: str = ""
    written: Mapping[str, int] = field(default_factory=dict)
    autograd: tuple[Callable[..., None], Callable[..., Any]] | None = None
    unfused: Callable[[Any, Any], Sequence[tuple[str, Any]]] | None = None
    mutates: tuple[str, ...] = ()
    advances: str = ""
    schema: str = field(default="", init=False)
    _flatten: Callable[..., list] | None = field(default=None, init=False, repr=False)
    _library_op: Any = field(default=None, init=False, repr=False)
    _list_result: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.kernel = self.kernel or self.name

    # ------------------------------------------------------------------ torch.compile path
    def traced(self, *args: Any, **kwargs: Any) -> Any:
        """The call through ``torch.ops.tileplug.<name>`` (what the public function does while
        ``torch.compiler.is_compiling()``, and for a differentiable op while autograd records):
        inputs detached unless the op declares ``autograd``; ``out=`` is refused (the compiled
        graph allocates) unless the op declares it in ``written``, whose tensors receive a
        copy of the fresh result and are returned in its place."""
        given = {name: kwargs.pop(name, None) for name in self.written}
        if kwargs.pop("out", None) is not None:
            raise ContractError(self.name, "out", "None under torch.compile (use the returned tensors)", "a tensor")
        flat = self._flatten(*args, **kwargs)
        result = self._library_op(*flat)
        if self._list_result:
            result = result[0] if len(result) == 1 else tuple(result)
        if any(tensor is not None for tensor in given.values()):
            result = _written_into(self.name, result, given, self.written)
        return result

    def library_op(self) -> Any:
        """``torch.ops.tileplug.<name>`` (the custom op object)."""
        return self._library_op

    def produced(self, result: Any, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        """The tensors a call ``function(*args, **kwargs)`` that returned ``result`` produced:
        the returned tensors, or for an in-place op the mutated arguments it was given, in
        order; an absent optional one is None; then the offset tensor of the generator an op
        that ``advances`` one was given. What tests and the conformance suite compare."""
        if not self.mutates and not self.advances:
            return list(result) if isinstance(result, (tuple, list)) else [result]
        bound = inspect.signature(self.function).bind(*args, **kwargs)
        bound.apply_defaults()
        if self.mutates:
            return [bound.arguments[name] for name in self.mutates]
        produced = list(result) if isinstance(result, (tuple, list)) else [result]
        generator = bound.arguments[self.advances]
        return produced if generator is None else [*produced, generator.offset_state]


_table: dict[str, OpDef] = {}
_table_lock = threading.Lock()


def bound_contract(function: Callable[..., Any], builder: Callable[..., Any],
                   parameters: Sequence[str] | None = None, by_name: bool = False, **fixed: Any) -> Callable[..., Any]:
    """A declaration's ``contract``: the arguments of a call of the public ``function`` (any mix
    of positional and keyword, defaults filled, ``out`` dropped) passed on to the contract
    ``builder`` — all of them in order (``parameters`` None), else the named ``parameters`` in
    that order (positionally, or as keywords with ``by_name``) — with the ``fixed`` keywords.

    The arguments are bound by :func:`argument_binder` (a function with ``function``'s own
    signature, made once here), not by ``inspect.Signature.bind`` per call, which cost three
    quarters of a contract's host time."""
    signature = inspect.signature(function)
    names = [name for name in signature.parameters if name != "out"] if parameters is None else list(parameters)
    assert set(names) <= set(signature.parameters), (function, names)
    bind = argument_binder(signature, names, getattr(function, "__name__", "op"))
    if "out" not in signature.parameters:  # (an ``out`` keyword is dropped all the same)
        bind_given = bind

        def bind(*args: Any, **kwargs: Any) -> tuple:
            kwargs.pop("out", None)
            return bind_given(*args, **kwargs)

    if by_name:
        def contract(*args: Any, **kwargs: Any) -> Any:
            return builder(**dict(zip(names, bind(*args, **kwargs))), **fixed)
    elif fixed:
        def contract(*args: Any, **kwargs: Any) -> Any:
            return builder(*bind(*args, **kwargs), **fixed)
    else:
        def contract(*args: Any, **kwargs: Any) -> Any:
            return builder(*bind(*args, **kwargs))

    return contract


def argument_binder(signature: inspect.Signature, names: Sequence[str], function_name: str) -> Callable[..., tuple]:
    """A function taking the arguments ``signature`` takes (same kinds, same defaults, ``out``
    accepted and ignored) that returns the values of ``names``, in order, defaults filled: what
    ``signature.bind(...)`` with ``apply_defaults()`` gives, at the cost of a Python call. A wrong
    call raises Python's own ``TypeError``, naming ``function_name``. A signature with ``*args`` or
    ``**kwargs`` is bound by ``inspect`` instead."""
    parameters = list(signature.parameters.values())
    kinds = inspect.Parameter
    if any(p.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD) for p in parameters) or not function_name.isidentifier():
        def bind_slowly(*args: Any, **kwargs: Any) -> tuple:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return tuple(bound.arguments[name] for name in names)

        return bind_slowly
    defaults: dict[str, Any] = {}
    pieces: list[str] = []
    keyword_only_started = False
    for index, parameter in enumerate(parameters):
        if parameter.kind is kinds.KEYWORD_ONLY and not keyword_only_started:
            pieces.append("*")
            keyword_only_started = True
        piece = parameter.name
        if parameter.default is not inspect.Parameter.empty:
            defaults[f"_default_{index}"] = parameter.default
            piece += f"=_default_{index}"
        pieces.append(piece)
        if parameter.kind is kinds.POSITIONAL_ONLY and (
                index + 1 == len(parameters) or parameters[index + 1].kind is not kinds.POSITIONAL_ONLY):
            pieces.append("/")
    returned = "".join(f"{name}, " for name in names)
    source = f"def {function_name}({', '.join(pieces)}):\n    return ({returned})\n"
    namespace = dict(defaults)
    exec(compile(source, f"<argument binder of {function_name}>", "exec"), namespace)  # noqa: S102
    return namespace[function_name]


def declare(opdef: OpDef) -> OpDef:
    """Add ``opdef`` to the table and register its custom op; returns it. Declaring a name
    twice is an error (an op is declared once)."""
    with _table_lock:
        if opdef.name in _table:
            raise ValueError(f"op '{opdef.name}' is already declared")
        _register_library_op(opdef)
        _table[opdef.name] = opdef
    return opdef


def undeclare(name: str) -> None:
    """Remove an op from the table (tests declaring a toy op clean up with this; its custom
    op stays registered with torch, which cannot unregister one)."""
    with _table_lock:
        _table.pop(name, None)


def get(name: str) -> OpDef:
    """The declaration of public op ``name`` (KeyError if none)."""
    _load_families()
    return _table[name]


def all_ops() -> list[OpDef]:
    """Every declared op, in declaration order."""
    _load_families()
    return list(_table.values())


def names() -> list[str]:
    """Public names of every declared op."""
    return [opdef.name for opdef in all_ops()]


def kernel_names() -> set[str]:
    """Kernel-table keys a backend may hold (one per op or family of variants)."""
    return {opdef.kernel for opdef in all_ops()}


def ops_of_kernel(kernel: str) -> list[OpDef]:
    """The ops a kernel-table key serves."""
    return [opdef for opdef in all_ops() if opdef.kernel == kernel]


def wants_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records a call on these tensors (grad mode on, one requires grad):
    a differentiable op's public function then goes through :meth:`OpDef.traced`."""
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _written_into(op: str, result: Any, given: Mapping[str, Any], slots: Mapping[str, int]) -> Any:
    """``result`` with the caller's ``written`` tensors holding a copy of their elements."""
    elements = [result] if isinstance(result, torch.Tensor) else list(result)
    for name, tensor in given.items():
        if tensor is None:
            continue
        from tileplug.core.contracts.checks import describe

        fresh = elements[slots[name]]
        if not isinstance(tensor, torch.Tensor) or tensor.shape != fresh.shape or tensor.dtype != fresh.dtype:
            raise ContractError(op, name, f"a tensor of shape {tuple(fresh.shape)} and dtype {fresh.dtype}",
                                describe(tensor))
        if tensor.requires_grad:
            raise ContractError(op, name, "a tensor that does not require grad (it is written in place)",
                                describe(tensor))
        tensor.copy_(fresh)
        elements[slots[name]] = tensor
    return elements[0] if isinstance(result, torch.Tensor) else tuple(elements)


def _load_families() -> None:
    if not _table:
        import tileplug.core.ops  # noqa: F401 - declares the built-in families


# ---------------------------------------------------------------------- eager dispatch

def run(call: Any, inputs: Sequence[Any], out: Any = None, given: Any = None) -> Any:
    """The eager path of every op: cached route → allocation (or ``out=`` checked against
    the same plan) → launch (skipped when there is nothing to compute) → result.

    ``given``: output tensors the contract already checked (an op's ``written`` arguments,
    which may alias inputs), passed to ``plan.allocate(tokens, device, given)``, which
    allocates only the outputs not given."""
    route = registry.route(call)
    if given is not None:
        outputs = route.plan.allocate(call.tokens, call.device, given)
    elif out is None:
        outputs = route.plan.allocate(call.tokens, call.device)
    else:
        outputs = route.check_out(call, out, inputs)
    if not call.empty:
        try:
            (route.launcher or route.prepare())(inputs, outputs)
        except Exception as error:
            raise BackendError(route.backend.name, call, error) from error
    return route.result(call, outputs)


def describe_call(op: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Check ``op``'s contract for these arguments and return ``(call, inputs)`` without running.

    ``op`` is a public op function or its name; inputs may be ``meta`` tensors, so calls
    for any device can be described anywhere.
    """
    opdef = _opdef_of(op)
    kwargs.pop("out", None)
    return opdef.contract(*args, **kwargs)


def _opdef_of(op: Callable[..., Any] | str) -> OpDef:
    _load_families()
    if isinstance(op, str):
        opdef = _table.get(op)
    else:
        opdef = next((d for d in _table.values() if d.function is op), None)
    if opdef is None:
        raise ContractError("describe_call", "op", f"a declared op or its name (one of {', '.join(_table)})", op)
    return opdef


def allocate_without_backend(op: str, traits: Any, *args: Any, **kwargs: Any) -> Any:
    """What ``op(*args, **kwargs)`` returns, allocated (not computed) for a backend with
    ``traits``: builds inputs of one op for another on meta without any backend installed."""
    opdef = get(op)
    call, _ = opdef.contract(*args, **kwargs)
    outputs = opdef.outputs(call, traits).allocate(call.tokens, call.device)
    return opdef.result(call, outputs)


# ---------------------------------------------------------------------- torch.library


def _schema_type(annotation: Any, name: str) -> list[tuple[str, str]]:
    """Schema arguments ``[(name, type)]`` of one Python parameter. A tensor-or-pair
    parameter becomes two: ``name`` and ``name_scales`` (None for a plain tensor); a
    ``Generator | None`` two: ``name_seed`` and ``name_offset`` (its state tensors); a
    tensor-or-tuple-of-tensors parameter one ``Tensor[]`` (a lone tensor is a one-element list)."""
    origin = typing.get_origin(annotation)
    members = typing.get_args(annotation) if origin in (typing.Union, types.UnionType) else (annotation,)
    optional = type(None) in members
    members = tuple(m for m in members if m is not type(None))
    if members and all(_is_generator_class(m) for m in members):
        return [(f"{name}_seed", "Tensor?"), (f"{name}_offset", "Tensor?")]
    if not optional and any(_is_tensor_sequence(m) for m in members) and all(
        m is torch.Tensor or _is_tensor_sequence(m) for m in members
    ):
        return [(name, "Tensor[]")]
    pairs = [m for m in members if typing.get_origin(m) is tuple and typing.get_args(m)[:1] == (torch.Tensor,)]
    if pairs:
        first = "Tensor?" if optional else "Tensor"
        return [(name, first), (f"{name}_scales", "Tensor" if members == tuple(pairs) and not optional else "Tensor?")]
    if members == (torch.Tensor,):
        return [(name, "Tensor?" if optional else "Tensor")]
    mark = "?" if optional else ""
    if len(members) == 1:
        member = members[0]
        if member is bool:
            return [(name, "bool" + mark)]
        if member is int:
            return [(name, "int" + mark)]
        if member is float:
            return [(name, "float" + mark)]
        if member is str:
            return [(name, "str" + mark)]
        if member is torch.dtype:
            return [(name, "ScalarType" + mark)]
        if typing.get_origin(member) is tuple and all(a is int for a in typing.get_args(member)):
            return [(name, "int[]" + mark)]
    raise TypeError(f"parameter '{name}': no torch.library schema type for {annotation!r}")


def _is_generator_class(annotation: Any) -> bool:
    """``tileplug.core.random.Generator``: a parameter the schema carries as its two state
    tensors (``name_seed``, ``name_offset``; None for None), rebuilt with ``Generator.over``."""
    from tileplug.core.generator import Generator

    return annotation is Generator


def _is_tensor_sequence(annotation: Any) -> bool:
    """``tuple[torch.Tensor, ...]``."""
    return typing.get_origin(annotation) is tuple and typing.get_args(annotation) == (torch.Tensor, Ellipsis)


def _return_type(annotation: Any) -> str:
    """Schema return of a return annotation: ``Tensor``; a fixed tuple ``(Tensor, Tensor?)``
    (``| None`` members may be None); ``Tensor[]`` for a result whose length depends on the
    arguments (``tuple[torch.Tensor, ...]`` or ``torch.Tensor | tuple[...]``: a one-element
    list is returned as the tensor itself); ``()`` for None (an in-place op)."""
    if annotation is None or annotation is type(None):
        return "()"
    if annotation is torch.Tensor:
        return "Tensor"
    origin, members = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is tuple and len(members) == 2 and members[1] is Ellipsis and members[0] is torch.Tensor:
        return "Tensor[]"
    if origin is tuple and members:
        kinds = []
        for member in members:
            inner = typing.get_args(member) if typing.get_origin(member) in (typing.Union, types.UnionType) else ()
            if member is torch.Tensor:
                kinds.append("Tensor")
            elif set(inner) == {torch.Tensor, type(None)}:
                kinds.append("Tensor?")
            else:
                break
        else:
            return "(" + ", ".join(kinds) + ")"
    if origin in (typing.Union, types.UnionType) and torch.Tensor in members and all(
        m is torch.Tensor or typing.get_origin(m) is tuple for m in members
    ):
        return "Tensor[]"
    raise TypeError(f"return type {annotation!r}: an op returns a tensor, a tuple of tensors or (in place) None")


def _written_alias(kind: str, index: int) -> str:
    """The schema type ``kind`` (``Tensor`` or ``Tensor?``) written in place, as alias set ``index``
    (0: ``Tensor(a!)``, 1: ``Tensor(b!)``, ...)."""
    return kind.replace("Tensor", f"Tensor({chr(ord('a') + index)}!)", 1)


def _mutated_schema(slots: list[tuple[str, list[tuple[str, str]], Any]], mutates: tuple[str, ...]) -> None:
    """Mark the mutated tensor parameters of ``slots`` with alias annotations ``Tensor(a!)``."""
    known = {name: expanded for name, expanded, _ in slots}
    for index, name in enumerate(mutates):
        expanded = known.get(name)
        if expanded is None or len(expanded) != 1 or not expanded[0][1].startswith("Tensor"):
            raise TypeError(f"mutated parameter '{name}': not a tensor parameter of the function")
        argument, kind = expanded[0]
        expanded[0] = (argument, _written_alias(kind, index))


def _advanced_schema(slots: list[tuple[str, list[tuple[str, str]], Any]], name: str, index: int) -> str:
    """Mark the offset tensor of the generator parameter ``name`` mutated (``Tensor(x!)?``, the
    ``index``-th alias set) in ``slots``; its schema name."""
    known = {slot: expanded for slot, expanded, _ in slots}
    expanded = known.get(name)
    if expanded is None or [argument for argument, _ in expanded] != [f"{name}_seed", f"{name}_offset"]:
        raise TypeError(f"advanced parameter '{name}': not a Generator parameter of the function")
    argument, kind = expanded[1]
    expanded[1] = (argument, _written_alias(kind, index))
    return argument


def _register_library_op(opdef: OpDef) -> None:
    function = opdef.function
    hints = typing.get_type_hints(function)
    excluded = {"out", *opdef.written}
    parameters = [p for p in inspect.signature(function).parameters.values() if p.name not in excluded]
    slots: list[tuple[str, list[tuple[str, str]], Any]] = []
    for parameter in parameters:
        slots.append((parameter.name, _schema_type(hints[parameter.name], parameter.name), parameter.default))
    returns = _return_type(hints["return"])
    mutated = opdef.mutates
    if opdef.mutates:
        if returns != "()":
            raise TypeError(f"op '{opdef.name}' mutates {opdef.mutates}: its function must return None")
        _mutated_schema(slots, opdef.mutates)
    if opdef.advances:
        mutated = (*mutated, _advanced_schema(slots, opdef.advances, len(mutated)))
    arguments = ", ".join(f"{kind} {arg}" for _, expanded, _ in slots for arg, kind in expanded)
    opdef.schema = f"({arguments}) -> {returns}"
    names = [parameter.name for parameter in parameters]
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    generators = {name for name, expanded, _ in slots if expanded[0][0] == f"{name}_seed"}
    splits = {name for name, expanded, _ in slots if len(expanded) == 2} - generators
    sequences = {name for name, expanded, _ in slots if expanded == [(name, "Tensor[]")]}
    detach = _detached if opdef.autograd is None else _as_is
    list_result = opdef.schema.endswith("-> Tensor[]")

    def flatten(*args: Any, **kwargs: Any) -> list:
        values = dict(defaults)
        values.update(zip(names, args))
        values.update(kwargs)
        flat: list = []
        for name in names:
            value = values[name]
            if name in generators:
                if value is not None and not _is_generator_class(type(value)):
                    raise ContractError(opdef.name, name, "a tileplug.core.random.Generator or None", describe(value))
                flat.extend((None, None) if value is None else (value.seed_state, value.offset_state))
            elif name in splits:
                if isinstance(value, (tuple, list)):
                    if len(value) != 2:
                        raise ContractError(opdef.name, name, "a tensor or a pair (xq, sf)", value)
                    flat.extend(detach(v) for v in value)
                else:
                    flat.extend((detach(value), None))
            elif name in sequences and isinstance(value, (torch.Tensor, tuple, list)):
                flat.append([detach(v) for v in ((value,) if isinstance(value, torch.Tensor) else value)])
            elif isinstance(value, torch.Tensor):
                flat.append(detach(value))
            elif isinstance(value, tuple):
                flat.append(list(value))
            else:
                flat.append(value)
        return flat

    def unflatten(flat: Sequence[Any]) -> dict[str, Any]:
        """The schema arguments as the public function's keyword arguments."""
        values = iter(flat)
        rebuilt = {}
        for name in names:
            value = next(values)
            if name in generators:
                from tileplug.core.generator import Generator

                offset = next(values)
                value = None if value is None else Generator.over(value, offset)
            elif name in splits:
                scales = next(values)
                value = value if scales is None else (value, scales)
            elif isinstance(value, list):
                value = tuple(value)
            rebuilt[name] = value
        return rebuilt

    def as_schema_result(result: Any) -> Any:
        if list_result:
            return [result] if isinstance(result, torch.Tensor) else list(result)
        return result

    def implementation(*flat: Any) -> Any:
        if opdef.mutates:
            opdef.function(**unflatten(flat))
            return None
        if opdef.autograd is None:
            return as_schema_result(_owned(opdef.function(**unflatten(flat)), flat))
        with torch.no_grad():  # the eager path: autograd is the custom op's registration
            return as_schema_result(_owned(opdef.function(**unflatten(flat)), flat))

    def fake(*flat: Any) -> Any:
        call, _ = opdef.contract(**unflatten(flat))
        if opdef.mutates:  # in place: the mutated inputs are the outputs, nothing to allocate
            return None
        route = registry.route(call)
        return as_schema_result(route.result(call, route.plan.allocate(call.tokens, call.device)))

    library_op = torch.library.custom_op(
        f"{LIBRARY_NAMESPACE}::{opdef.name}", implementation, mutates_args=mutated, schema=opdef.schema
    )
    library_op.register_fake(fake)
    if opdef.autograd is not None:
        setup_context, backward = opdef.autograd
        library_op.register_autograd(backward, setup_context=setup_context)
    opdef._flatten = flatten
    opdef._library_op = library_op
    opdef._list_result = list_result


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) and value.requires_grad else value


def _as_is(value: Any) -> Any:
    return value


def _owned(result: Any, flat: Sequence[Any]) -> Any:
    """A custom op may not return an input (or a view of one): copy any such output."""
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    if isinstance(result, torch.Tensor):
        return result.clone() if any(result is t for t in tensors) else result
    return tuple(r.clone() if r is not None and any(r is t for t in tensors) else r for r in result)
