"""Arithmetic: exact computation with integers, fractions, bases, matrices and polynomials."""
from __future__ import annotations

import math
from fractions import Fraction

from envs.base import register
from envs.gym._util import (
    INVALID, FracAnswer, GymEnv, IntAnswer, ListAnswer, StrAnswer, fmt_grid, frac_str, grow_until, parse_grid,
)

F = "arithmetic"


def _num(rng, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


@register("gym/long_multiplication")
class LongMultiplication(IntAnswer):
    family, description = F, "Multiply two many-digit integers exactly."

    def build(self, rng, d):
        a, b = _num(rng, 2 + d), _num(rng, 1 + (d + 1) // 2)
        return f"Compute {a} * {b} exactly.", a * b


@register("gym/long_division")
class LongDivision(ListAnswer):
    family, description, partial = F, "Integer division: quotient and remainder.", False

    def build(self, rng, d):
        a, b = _num(rng, 3 + d), _num(rng, 1 + d // 2)
        return (f"Divide {a} by {b}. Give the quotient and the remainder (0 <= r < {b}) as two integers "
                f"separated by a space: q r.", [a // b, a % b])


@register("gym/expression_eval")
class ExpressionEval(IntAnswer):
    family, description = F, "Evaluate a nested integer expression with +, - and *."

    def build(self, rng, d):
        def expr(n):  # n operators
            if n == 0:
                v = rng.randint(1, 9 + d)
                return str(v), v
            k = rng.randrange(n)
            (ls, lv), (rs, rv) = expr(k), expr(n - 1 - k)
            op = rng.choice("+-*" if n < 4 else "+-+-*")
            v = lv + rv if op == "+" else lv - rv if op == "-" else lv * rv
            return f"({ls} {op} {rs})", v

        s, v = expr(grow_until(2, d, 30, 5, 1.08))  # 1.08^d operators to difficulty 30 (50), then 5 per level
        return f"Evaluate the expression {s[1:-1]}.", v


@register("gym/fraction_sum")
class FractionSum(FracAnswer):
    family, description = F, "Add and subtract fractions; answer in lowest terms."

    def build(self, rng, d):
        k = grow_until(2, d, 30, 10, 1.1, 0.5)  # 1.1^d terms to difficulty 30 (49), then 10 per level
        terms = [Fraction(rng.randint(1, 9 + d), rng.randint(2, 9 + 2 * d)) * rng.choice((1, -1)) for _ in range(k)]
        s = " ".join(f"{'+' if t > 0 else '-'} {abs(t.numerator)}/{t.denominator}" for t in terms).lstrip("+ ")
        return f"Compute {s}. Give the result as a reduced fraction p/q (or an integer).", frac_str(sum(terms))


@register("gym/power_sum")
class PowerSum(IntAnswer):
    family, description = F, "Sum of k-th powers 1^k + ... + n^k."

    def build(self, rng, d):
        n, k = rng.randint(5 + 2 * d, 10 + 5 * d), rng.randint(1, 2 + d // 3)
        return f"Compute 1^{k} + 2^{k} + ... + {n}^{k}.", sum(i ** k for i in range(1, n + 1))


_DIG = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _to_base(n: int, b: int) -> str:
    s = ""
    while True:
        n, r = divmod(n, b)
        s = _DIG[r] + s
        if n == 0:
            return s


@register("gym/base_conversion")
class BaseConversion(StrAnswer):
    family, description, fold_case = F, "Convert an integer between number bases.", True

    def build(self, rng, d):
        b1, b2 = rng.sample([2, 3, 5, 7, 8, 10, 12, 16], 2)
        n = rng.randint(b1 ** (2 + d), b1 ** (3 + d))
        return (f"Convert the base-{b1} number {_to_base(n, b1)} to base {b2}. Use digits 0-9 and then "
                f"letters A-Z for digit values 10 and above; no prefix.", _to_base(n, b2))

    def wrong_answers(self, problem):
        a = problem.answer
        return [a + "1", ("1" if a[0] != "1" else "2") + a[1:], a[::-1] + "0"]


@register("gym/digit_sum_power")
class DigitSumPower(IntAnswer):
    family, description = F, "Sum of the decimal digits of a^b."
    max_difficulty = 407  # 416^1638 has 4291 digits; 417^1642 (difficulty 408) exceeds Python's 4300-digit str limit

    def build(self, rng, d):
        d = min(d, 407)
        a, b = rng.randint(2, 9 + d), rng.randint(5 + d, 10 + 4 * d)
        return f"What is the sum of the decimal digits of {a}^{b}?", sum(map(int, str(a ** b)))


def det(mat) -> int:
    m = [[Fraction(x) for x in row] for row in mat]
    n, res = len(m), Fraction(1)
    for c in range(n):
        p = next((r for r in range(c, n) if m[r][c] != 0), None)
        if p is None:
            return 0
        if p != c:
            m[c], m[p] = m[p], m[c]
            res = -res
        res *= m[c][c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            if f:
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return int(res)


@register("gym/matrix_determinant")
class MatrixDeterminant(IntAnswer):
    family, description = F, "Determinant of an integer matrix."

    def build(self, rng, d):
        n = 2 + d // 2
        m = [[rng.randint(-5 - d, 5 + d) for _ in range(n)] for _ in range(n)]
        return f"Compute the determinant of the {n}x{n} matrix (rows separated by ';'): {fmt_grid(m)}", det(m)


@register("gym/matrix_multiply")
class MatrixMultiply(GymEnv):
    family, description = F, "Product of two integer matrices (partial credit per entry)."

    def build(self, rng, d):
        n, m, p = (rng.randint(2, 2 + d // 2) for _ in range(3))
        a = [[rng.randint(-9, 9) for _ in range(m)] for _ in range(n)]
        b = [[rng.randint(-9, 9) for _ in range(p)] for _ in range(m)]
        c = [[sum(a[i][k] * b[k][j] for k in range(m)) for j in range(p)] for i in range(n)]
        return (f"Let A = {fmt_grid(a)} and B = {fmt_grid(b)} (rows separated by ';'). Compute A*B; write "
                f"its rows separated by ';' and entries by spaces.", c)

    def format_answer(self, answer):
        return fmt_grid(answer)

    def parse(self, text, problem):
        return parse_grid(text)

    def grade(self, problem, value):
        ref = problem.answer
        if [len(r) for r in value] != [len(r) for r in ref]:
            return INVALID
        ok = sum(x == y for r1, r2 in zip(value, ref) for x, y in zip(r1, r2))
        return (ok / sum(map(len, ref))) ** 10

    def wrong_answers(self, problem):
        ref = problem.answer
        bad = [r[:] for r in ref]
        bad[0][0] += 1
        return [fmt_grid(bad), fmt_grid(ref[:-1]), fmt_grid([list(r) for r in zip(*ref)]) if len(ref) != len(ref[0])
                else fmt_grid([[x + 1 for x in r] for r in ref])]


@register("gym/polynomial_multiply")
class PolynomialMultiply(ListAnswer):
    family, description = F, "Coefficients of the product of two integer polynomials."

    def build(self, rng, d):
        def poly(deg):
            c = [rng.randint(-5, 5) for _ in range(deg)] + [rng.choice([-3, -2, -1, 1, 2, 3])]
            return c

        def show(c):
            return " + ".join(f"({x})x^{i}" for i, x in enumerate(c) if x) or "0"

        p, q = poly(rng.randint(1, 2 + d // 2)), poly(rng.randint(1, 2 + d // 2))
        r = [0] * (len(p) + len(q) - 1)
        for i, x in enumerate(p):
            for j, y in enumerate(q):
                r[i + j] += x * y
        return (f"Let p(x) = {show(p)} and q(x) = {show(q)}. List the coefficients of p(x)*q(x) from x^0 up "
                f"to x^{len(r) - 1}, separated by spaces.", r)


_ROMAN = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"), (40, "XL"),
          (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]


def to_roman(n: int) -> str:
    s = ""
    for v, r in _ROMAN:
        while n >= v:
            s, n = s + r, n - v
    return s


@register("gym/roman_sum")
class RomanSum(IntAnswer):
    family, description = F, "Add numbers written as Roman numerals; answer in decimal."

    def build(self, rng, d):
        xs = [rng.randint(1, min(3999, 20 * (d + 1) ** 2)) for _ in range(grow_until(2, d, 30, 10, 1.1, 0.5))]
        return f"Compute {' + '.join(map(to_roman, xs))} (Roman numerals). Give the sum as a decimal integer.", sum(xs)


@register("gym/integer_sqrt")
class IntegerSqrt(IntAnswer):
    family, description = F, "Floor of the square root of a large integer."

    def build(self, rng, d):
        n = _num(rng, 4 + 2 * d)
        return f"Compute the floor of the square root of {n}.", math.isqrt(n)
