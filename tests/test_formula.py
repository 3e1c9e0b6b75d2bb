"""Tests for the score formula evaluator."""

from __future__ import annotations

import math
import operator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvchunkfs.formula import FIELDS, FormulaError, compile_formula

ZERO_FIELDS = dict.fromkeys(FIELDS, 0.0)


def ev(text: str, **fields: float) -> float:
    return compile_formula(text).evaluate({**ZERO_FIELDS, **fields})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1 + 2 * 3", 7.0),
        ("(1 + 2) * 3", 9.0),
        ("-2 ** 2", -4.0),
        ("2 ** 3 ** 2", 512.0),
        ("7 // 2", 3.0),
        ("-7 // 2", -4.0),
        ("7 % 3", 1.0),
        ("7 / 2", 3.5),
        ("+3 - -2", 5.0),
        ("1e3 + 1_000", 2000.0),
        ("min(3, 1, 2)", 1.0),
        ("max(3, 1, 2)", 3.0),
        ("min(4)", 4.0),
        ("log(8, 2)", 3.0),
        ("log2(1024)", 10.0),
        ("sqrt(16)", 4.0),
        ("abs(-3)", 3.0),
        ("log(1)", 0.0),
    ],
)
def test_arithmetic(text: str, expected: float) -> None:
    assert ev(text) == pytest.approx(expected)


def test_fields_are_read() -> None:
    f = compile_formula("size / chunks + use_count")
    assert f.names == frozenset({"size", "chunks", "use_count"})
    assert f.evaluate({"size": 100, "chunks": 4, "use_count": 2}) == 27.0


def test_natural_log() -> None:
    assert ev("log(size)", size=math.e**3) == pytest.approx(3.0)


@pytest.mark.parametrize(
    "text",
    ["size / 0", "size // 0", "size % 0", "size / (chunks - chunks)", "log(0)", "log(-1)", "log2(0)",
     "sqrt(-4)", "(-8) ** 0.5", "0 ** -1", "log(8, 1)", "log(8, 0)", "log(8, -2)"],
)  # fmt: skip
def test_undefined_results_are_zero(text: str) -> None:
    assert ev(text, size=5.0, chunks=3.0) == 0.0


def test_pow_overflow_is_infinite() -> None:
    assert ev("10 ** 400") == math.inf
    assert ev("(-10) ** 401") == -math.inf
    assert ev("(-10) ** 400") == math.inf


def test_nan_result_is_zero() -> None:
    assert ev("size - size", size=math.inf) == 0.0


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("size +", "syntax error"),
        ("foo + 1", "unknown name 'foo'"),
        ("exp(1)", "unknown function"),
        ("size.real", "unsupported syntax"),
        ("__import__('os').system('true')", "unknown function"),
        ("(lambda: 1)()", "unknown function"),
        ("size < 3", "unsupported syntax"),
        ("size if chunks else 1", "unsupported syntax"),
        ("'a'", "unsupported constant"),
        ("True", "unsupported constant"),
        ("1j", "unsupported constant"),
        ("[1][0]", "unsupported syntax"),
        ("log(x=1)", "positional"),
        ("max(*[1, 2])", "positional"),
        ("sqrt(1, 2)", "takes 1 argument"),
        ("log2(8, 2)", "takes 1 argument"),
        ("log()", "takes 1 to 2"),
        ("min()", "1 or more"),
        ("log + 1", "without a call"),
        ("size & 1", "unsupported syntax"),
        ("not size", "unsupported syntax"),
        ("size; 1", "syntax error"),
        ("size = 1", "syntax error"),
        ("1" * 400, "number too large"),
    ],
)
def test_rejected(text: str, fragment: str) -> None:
    with pytest.raises(FormulaError, match=fragment.replace("(", r"\(")):
        compile_formula(text)


def test_too_long_and_too_deep() -> None:
    with pytest.raises(FormulaError, match="longer"):
        compile_formula("1 + " * 600 + "1")
    with pytest.raises(FormulaError, match="nested"):
        compile_formula("1 + " * 100 + "1")
    with pytest.raises(FormulaError, match="nested"):
        compile_formula("abs(" * 100 + "1" + ")" * 100)
    # Parentheses alone add no nesting.
    assert compile_formula("(" * 150 + "1" + ")" * 150).evaluate({}) == 1.0


def test_formula_error_is_value_error() -> None:
    assert issubclass(FormulaError, ValueError)


def test_missing_and_bad_fields() -> None:
    f = compile_formula("size + chunks")
    with pytest.raises(FormulaError, match="chunks"):
        f.evaluate({"size": 1})
    with pytest.raises(FormulaError, match="not a number"):
        f.evaluate({"size": 1, "chunks": "many"})


def test_custom_names() -> None:
    f = compile_formula("a * b", names=("a", "b"))
    assert f.evaluate({"a": 2, "b": 3}) == 6.0
    with pytest.raises(FormulaError, match="unknown name 'size'"):
        compile_formula("size", names=("a",))


_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
        "//": operator.floordiv, "%": operator.mod}  # fmt: skip
_finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@given(a=_finite, b=_finite, op=st.sampled_from(sorted(_OPS)))
def test_binary_ops_match_python(a: float, b: float, op: str) -> None:
    got = ev(f"size {op} chunks", size=a, chunks=b)
    if b == 0 and op in ("/", "//", "%"):
        assert got == 0.0
    else:
        assert got == _OPS[op](a, b)


_any_float = st.floats(allow_nan=False) | st.integers(min_value=-(10**6), max_value=10**12)


@given(values=st.fixed_dictionaries({name: _any_float for name in FIELDS}))
def test_evaluation_never_raises_and_never_nan(values: dict[str, float]) -> None:
    nasty = (
        "log(size) * sqrt(shared_bytes) / (use_count - chunks) ** age_hours"
        " + log2(idle_hours) // last_use % created - max(unique_bytes, -size)"
    )
    for text in (nasty, "(1 + use_count) / (1 + idle_hours) / (1 + unique_bytes / 1048576)"):
        result = compile_formula(text).evaluate(values)
        assert isinstance(result, float)
        assert not math.isnan(result)


def _formulas() -> st.SearchStrategy[str]:
    leaf = st.sampled_from(FIELDS) | st.sampled_from(["0", "1", "2.5", "1e6", "-3"])
    funcs = ["min", "max", "log", "log2", "sqrt", "abs"]

    def grow(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        binop = st.tuples(inner, st.sampled_from(["+", "-", "*", "/", "//", "%", "**"]), inner).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"
        )
        unary = inner.map(lambda x: f"-({x})")
        call = st.tuples(st.sampled_from(funcs), inner, inner).map(
            lambda t: f"{t[0]}({t[1]}, {t[2]})" if t[0] in ("min", "max", "log") else f"{t[0]}({t[1]})"
        )
        return binop | unary | call

    return st.recursive(leaf, grow, max_leaves=8)


@given(text=_formulas(), rows=st.lists(st.fixed_dictionaries({name: _any_float for name in FIELDS}), max_size=6))
def test_evaluating_columns_gives_what_evaluating_each_row_gives(text: str, rows: list[dict[str, float]]) -> None:
    """The listing scores every row at once over columns; each score must equal the row's own."""
    formula = compile_formula(text)
    columns = {name: [float(r[name]) for r in rows] for name in FIELDS}
    got = formula.evaluate_many(columns, len(rows))
    want = [formula.evaluate(r) for r in rows]
    assert [repr(x) for x in got] == [repr(x) for x in want]
