"""Safe evaluator for the snapshot score formula (setting ``score``).

The formula is parsed with :mod:`ast` and only whitelisted nodes are turned into plain Python closures;
the user's text is never passed to ``eval`` or ``compile``.

Language
--------
One arithmetic expression, evaluated in floating point:

* numbers: ``3``, ``0.5``, ``1e6``, ``1_048_576``;
* field names, whose values the caller passes at evaluation time: ``size``, ``unique_bytes``,
  ``shared_bytes``, ``chunks``, ``use_count``, ``age_hours``, ``idle_hours``, ``last_use``, ``created``;
* binary operators ``+ - * / // % **``, unary ``-`` and ``+``, parentheses; precedence is Python's
  (``-2 ** 2 == -4``, ``**`` is right-associative);
* functions: ``min(a, b, ...)``, ``max(a, b, ...)``, ``log(x)`` (natural) or ``log(x, base)``, ``log2(x)``,
  ``sqrt(x)``, ``abs(x)``.

Evaluation never raises on numeric input, so one odd snapshot cannot fail a whole listing:

* ``x / 0``, ``x // 0`` and ``x % 0`` yield ``0.0``;
* outside a function's domain (``log`` or ``log2`` of ``x <= 0``, a bad ``log`` base, ``sqrt`` of
  ``x < 0``, a negative number to a fractional power, ``0 ** -1``) the result is ``0.0``;
* ``**`` overflow yields ``inf`` (``-inf`` for a negative base with an odd integer exponent);
* a NaN final result becomes ``0.0``.

Anything else (unknown names or functions, comparisons, attributes, strings, keyword arguments, ...)
is rejected by :func:`compile_formula` with a :class:`FormulaError`.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

FIELDS: tuple[str, ...] = (
    "size",
    "unique_bytes",
    "shared_bytes",
    "chunks",
    "use_count",
    "age_hours",
    "idle_hours",
    "last_use",
    "created",
)

# Bounds keep parsing and the closure tree's recursion far below Python's recursion limit.
MAX_LENGTH = 2000
MAX_DEPTH = 60

Fields = Mapping[str, float]
Evaluator = Callable[[Fields], float]
Columns = Mapping[str, Sequence[float]]
# The same formula over columns (one list of values per field, n rows): a listing of 50,000 rows
# evaluates each operator once per column through ``map`` instead of walking the closures per row.
ColumnEvaluator = Callable[[Columns, int], Sequence[float]]


class FormulaError(ValueError):
    """The formula text is invalid, or evaluation lacks a field it reads."""


def _div(a: float, b: float) -> float:
    return a / b


def _floordiv(a: float, b: float) -> float:
    return a // b


def _mod(a: float, b: float) -> float:
    return a % b


def _pow(a: float, b: float) -> float:
    try:
        result = a**b
    except OverflowError:
        odd = b.is_integer() and b % 2 == 1
        return -math.inf if a < 0 and odd else math.inf
    # A negative base to a fractional power gives a complex number in Python.
    return 0.0 if isinstance(result, complex) else result


def _log(x: float, base: float = math.e) -> float:
    return math.log(x, base)


def _min(*args: float) -> float:
    return min(args)


def _max(*args: float) -> float:
    return max(args)


_BINOPS: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: _div,
    ast.FloorDiv: _floordiv,
    ast.Mod: _mod,
    ast.Pow: _pow,
}

# name -> (function, min args, max args or None for unbounded)
_FUNCTIONS: dict[str, tuple[Callable[..., float], int, int | None]] = {
    "min": (_min, 1, None),
    "max": (_max, 1, None),
    "log": (_log, 1, 2),
    "log2": (math.log2, 1, 1),
    "sqrt": (math.sqrt, 1, 1),
    "abs": (abs, 1, 1),
}


def _safe(fn: Callable[..., float]) -> Callable[..., float]:
    """Make ``fn`` total: domain errors and division by zero give 0.0, overflow gives inf."""

    def wrapped(*args: float) -> float:
        try:
            return float(fn(*args))
        except (ZeroDivisionError, ValueError):
            return 0.0
        except OverflowError:
            return math.inf

    return wrapped


@dataclass(frozen=True)
class Formula:
    """A compiled formula; :meth:`evaluate` it once per snapshot."""

    text: str
    names: frozenset[str]
    _fn: Evaluator = field(repr=False, compare=False)
    _columns: ColumnEvaluator = field(repr=False, compare=False)

    def evaluate(self, fields: Fields) -> float:
        missing = sorted(n for n in self.names if n not in fields)
        if missing:
            raise FormulaError(f"score formula needs field(s) {', '.join(missing)}")
        result = self._fn(fields)
        return 0.0 if math.isnan(result) else result

    def evaluate_many(self, columns: Columns, n: int) -> list[float]:
        """``evaluate`` for ``n`` rows at once: ``columns`` maps each field in ``names`` to its
        ``n`` values (floats); the same results, in row order."""
        missing = sorted(name for name in self.names if name not in columns)
        if missing:
            raise FormulaError(f"score formula needs field(s) {', '.join(missing)}")
        return [0.0 if r != r else r for r in self._columns(columns, n)]  # r != r: NaN


def compile_formula(text: str, names: Iterable[str] = FIELDS) -> Formula:
    """Parse and check ``text``; ``names`` are the field names it may use."""
    if len(text) > MAX_LENGTH:
        raise FormulaError(f"formula longer than {MAX_LENGTH} characters")
    tree = _parse(text)
    _check_depth(tree.body, 0)
    compiler = _Compiler(frozenset(names))
    fn, columns = compiler.build(tree.body)
    return Formula(text=text, names=frozenset(compiler.used), _fn=fn, _columns=columns)


def _parse(text: str) -> ast.Expression:
    if not text.strip():
        raise FormulaError("empty formula")
    try:
        return ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise FormulaError(f"syntax error at column {e.offset}: {e.msg}") from None
    except (RecursionError, MemoryError, ValueError):
        raise FormulaError("formula too complex or malformed") from None


def _check_depth(node: ast.AST, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise FormulaError(f"formula nested deeper than {MAX_DEPTH} levels")
    for child in ast.iter_child_nodes(node):
        _check_depth(child, depth + 1)


# Float addition, subtraction and multiplication never raise (they overflow to inf): over columns
# they run in C through ``map`` without the ``_safe`` wrapper.
_NEVER_RAISE = frozenset({ast.Add, ast.Sub, ast.Mult})
Both = tuple[Evaluator, ColumnEvaluator]


class _Compiler:
    """Turns a whitelisted AST into nested closures (one per row, one over columns), recording the
    field names used."""

    def __init__(self, allowed: frozenset[str]) -> None:
        self.allowed = allowed
        self.used: set[str] = set()

    def build(self, node: ast.AST) -> Both:
        if isinstance(node, ast.Constant):
            return self._constant(node)
        if isinstance(node, ast.Name):
            return self._name(node)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return self._binop(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return self._unary(node)
        if isinstance(node, ast.Call):
            return self._call(node)
        raise FormulaError(f"unsupported syntax at column {_col(node)}: {_describe(node)}")

    def _constant(self, node: ast.Constant) -> Both:
        # bool is an int subclass: reject True/False explicitly.
        if type(node.value) not in (int, float):
            raise FormulaError(f"unsupported constant {node.value!r} at column {_col(node)}")
        try:
            value = float(node.value)  # type: ignore[arg-type]  # int or float, checked above
        except OverflowError:
            raise FormulaError(f"number too large at column {_col(node)}") from None
        return (lambda fields: value), (lambda cols, n: [value] * n)

    def _name(self, node: ast.Name) -> Both:
        name = node.id
        if name not in self.allowed:
            if name in _FUNCTIONS:
                raise FormulaError(f"function {name!r} used without a call at column {_col(node)}")
            known = ", ".join(sorted(self.allowed))
            raise FormulaError(f"unknown name {name!r} at column {_col(node)} (known fields: {known})")
        self.used.add(name)
        return (lambda fields: _field(fields, name)), (lambda cols, n: cols[name])

    def _binop(self, node: ast.BinOp) -> Both:
        raw = _BINOPS[type(node.op)]
        op = _safe(raw)
        fast = raw if type(node.op) in _NEVER_RAISE else op
        (left, left_cols), (right, right_cols) = self.build(node.left), self.build(node.right)
        return (lambda fields: op(left(fields), right(fields))), (
            lambda cols, n: list(map(fast, left_cols(cols, n), right_cols(cols, n)))
        )

    def _unary(self, node: ast.UnaryOp) -> Both:
        operand, operand_cols = self.build(node.operand)
        if isinstance(node.op, ast.USub):
            return (lambda fields: -operand(fields)), (lambda cols, n: list(map(operator.neg, operand_cols(cols, n))))
        return operand, operand_cols

    def _call(self, node: ast.Call) -> Both:
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
            known = ", ".join(sorted(_FUNCTIONS))
            raise FormulaError(f"unknown function {_describe(node.func)} at column {_col(node)} (known: {known})")
        name = node.func.id
        fn, lo, hi = _FUNCTIONS[name]
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise FormulaError(f"{name}() takes positional arguments only")
        if len(node.args) < lo or (hi is not None and len(node.args) > hi):
            expected = f"{lo}" if lo == hi else f"{lo} or more" if hi is None else f"{lo} to {hi}"
            raise FormulaError(f"{name}() takes {expected} argument(s), got {len(node.args)}")
        built = [self.build(a) for a in node.args]
        args = [b[0] for b in built]
        arg_cols = [b[1] for b in built]
        safe = _safe(fn)
        return (lambda fields: safe(*(a(fields) for a in args))), (
            lambda cols, n: list(map(safe, *(a(cols, n) for a in arg_cols)))
        )


def _field(fields: Fields, name: str) -> float:
    try:
        return float(fields[name])
    except KeyError:
        raise FormulaError(f"score formula needs field {name}") from None
    except (TypeError, ValueError):
        raise FormulaError(f"field {name} = {fields[name]!r} is not a number") from None


def _col(node: ast.AST) -> int:
    return getattr(node, "col_offset", 0) + 1


def _describe(node: ast.AST) -> str:
    try:
        return f"{type(node).__name__} {ast.unparse(node)!r}"
    except Exception:  # unparse is best effort, only for the message
        return type(node).__name__
