"""Number theory: divisibility, modular arithmetic, primes and Diophantine equations."""
from __future__ import annotations

import math
import re
from fractions import Fraction

from envs.base import register
from envs.gym._util import (
    INVALID, GymEnv, IntAnswer, ListAnswer, ParseError, factorize, fmt_list, grow, grow_until, is_prime, lcm,
    parse_int_list, random_prime,
)

F = "number_theory"


_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47)


def _smooth(rng, n_factors: int, primes=_PRIMES) -> int:
    x = 1
    for _ in range(n_factors):
        x *= rng.choice(primes)
    return x


@register("gym/gcd_lcm")
class GcdLcm(ListAnswer):
    family, description, partial = F, "GCD and LCM of a list of integers.", False

    def build(self, rng, d):
        g = _smooth(rng, 1 + d // 3)
        xs = [g * _smooth(rng, rng.randint(1, min(15, 2 + d // 3))) for _ in range(grow_until(2, d, 30, 2, 1.08, 0.3))]
        l = 1
        for x in xs:
            l = lcm(l, x)
        return (f"Find the greatest common divisor and the least common multiple of {fmt_list(xs, ', ')}. "
                f"Answer as two integers: gcd lcm.", [math.gcd(*xs), l])


@register("gym/mod_pow")
class ModPow(IntAnswer):
    family, description = F, "Modular exponentiation a^b mod m."

    def build(self, rng, d):
        m = rng.randint(10 ** (1 + d // 2), 10 ** (2 + d // 2))
        a, b = rng.randint(2, m - 1), rng.randint(10 ** (1 + d // 2), 10 ** (2 + d))
        return f"Compute {a}^{b} mod {m} (an integer in [0, {m - 1}]).", pow(a, b, m)


def crt(rs, ms):
    x, m = 0, 1
    for r, mi in zip(rs, ms):
        t = ((r - x) * pow(m, -1, mi)) % mi
        x, m = x + m * t, m * mi
    return x % m, m


@register("gym/crt")
class ChineseRemainder(IntAnswer):
    family, description = F, "Smallest non-negative solution of a system of congruences (coprime moduli)."

    def build(self, rng, d):
        k = 2 + d // 2
        ms: list[int] = []
        while len(ms) < k:
            m = rng.randint(2, 8 + 4 * d)
            if all(math.gcd(m, x) == 1 for x in ms):
                ms.append(m)
        rs = [rng.randrange(m) for m in ms]
        sys_ = ", ".join(f"x = {r} (mod {m})" for r, m in zip(rs, ms))
        return f"Find the smallest non-negative integer x with {sys_}.", crt(rs, ms)[0]


@register("gym/prime_factorization")
class PrimeFactorization(GymEnv):
    family, description = F, "Prime factorisation of an integer (any order, powers allowed)."

    def build(self, rng, d):
        ps = [random_prime(rng, 2, 10 + 20 * d) for _ in range(2 + d // 2)]
        n = math.prod(ps)
        return (f"Give the prime factorisation of {n} as a product like 2^3 * 5 * 7^2 (factors separated "
                f"by '*').", sorted(ps))

    def format_answer(self, answer):
        return " * ".join(map(str, answer))

    def parse(self, text, problem):
        t = re.sub(r"\\times|\\cdot|×|·", "*", text).strip().removesuffix(".")  # "2 * 3." as "42." reads as 42
        out = []
        for tok in (x.strip() for x in t.split("*")):
            m = re.fullmatch(r"(\d+)\s*(?:\^\s*\{?\s*(\d+)\s*\}?)?", tok)
            if not m or len(tok) > 200:
                raise ParseError(f"bad factor {tok[:30]!r}")
            e = int(m.group(2) or 1)
            if len(out) + e > 10_000:  # (before the list is built: 2^100000000 was 1.5 GB)
                raise ParseError("too many factors")
            out += [int(m.group(1))] * e
        return sorted(out)

    def grade(self, problem, value):
        # divide the factors out of n one at a time rather than multiply them: the product of "<190 nines>^9999" had
        # ~1.9M digits (18 s); a factor that does not divide what is left of n (a small number) ends it at once
        rest = math.prod(problem.answer)
        for p in value:
            if p < 2 or rest % p:
                return 0.0
            rest //= p
        return 1.0 if rest == 1 and all(is_prime(p) for p in value) else 0.0

    def wrong_answers(self, problem):
        ps = problem.answer
        return [" * ".join(map(str, ps[:-1])), " * ".join(map(str, ps + [2])),
                " * ".join(map(str, [ps[0] * ps[1]] + ps[2:])), "1 * " + " * ".join(map(str, ps[1:]))]


@register("gym/totient")
class Totient(IntAnswer):
    family, description = F, "Euler's totient function."

    def build(self, rng, d):
        n = _smooth(rng, 2 + d) * rng.choice([1, random_prime(rng, 50, 500)])
        phi = n
        for p in factorize(n):
            phi = phi // p * (p - 1)
        return f"Compute Euler's totient phi({n}).", phi


@register("gym/divisor_count")
class DivisorCount(IntAnswer):
    family, description = F, "Number of positive divisors of an integer."

    def build(self, rng, d):
        # exponents drawn, not a product of a few primes (almost always squarefree: 4 divisors at difficulty 0)
        primes = rng.sample(_PRIMES, rng.randint(1, min(len(_PRIMES), 2 + d // 3)))
        n = math.prod(q ** rng.randint(1, 2 + d // 2) for q in primes)
        return f"How many positive divisors does {n} have?", math.prod(e + 1 for e in factorize(n).values())


@register("gym/divisor_sum")
class DivisorSum(IntAnswer):
    family, description = F, "Sum of the positive divisors of an integer (sigma)."

    def build(self, rng, d):
        n = _smooth(rng, 2 + d, (2, 3, 5, 7, 11, 13, 17, 19, 23))
        s = math.prod((p ** (e + 1) - 1) // (p - 1) for p, e in factorize(n).items())
        return f"Compute the sum of all positive divisors of {n}.", s


@register("gym/linear_diophantine")
class LinearDiophantine(GymEnv):
    family, description = F, "Any integer solution of a x + b y = c."

    def build(self, rng, d):
        g = rng.randint(1, 3 + d)
        a, b = g * rng.randint(2, 10 ** (1 + d // 3)), g * rng.randint(2, 10 ** (1 + d // 3))
        x0, y0 = rng.randint(-20 - d, 20 + d), rng.randint(-20 - d, 20 + d)
        c = a * x0 + b * y0
        return (f"Find integers x and y with {a}x + {b}y = {c}. Answer as two integers: x y.", [x0, y0],
                {"abc": [a, b, c]})

    def format_answer(self, answer):
        return fmt_list(answer)

    def parse(self, text, problem):
        v = parse_int_list(text)
        if len(v) != 2 or any(abs(x) > 10 ** 60 for x in v):
            raise ParseError("expected two integers x y")
        return v

    def grade(self, problem, value):
        a, b, c = problem.meta["abc"]
        return 1.0 if a * value[0] + b * value[1] == c else 0.0

    def wrong_answers(self, problem):
        x, y = problem.answer
        return [f"{x + 1} {y}", f"{x} {y + 1}", f"{x}"]


@register("gym/mod_inverse")
class ModInverse(IntAnswer):
    family, description = F, "Modular multiplicative inverse."

    def build(self, rng, d):
        m = rng.randint(10 ** (1 + d // 2), 10 ** (2 + d // 2))
        a = rng.randint(2, m - 1)
        while math.gcd(a, m) != 1:
            a = rng.randint(2, m - 1)
        return f"Find the integer x in [0, {m - 1}] with {a} * x = 1 (mod {m}).", pow(a, -1, m)


@register("gym/continued_fraction")
class ContinuedFraction(GymEnv):
    family, description = F, "Continued fraction expansion of a rational number."

    def build(self, rng, d):
        # 1.08^d terms up to difficulty 30 (35), then 2 per level (175 at 100): 4450 terms made a numerator past
        # Python's 4300-digit int-to-str limit (and a 15k-digit prompt)
        k = grow_until(2, d, 30, 2, 1.08, 0.5)
        terms = [rng.randint(0, 5 + d)] + [rng.randint(1, 5 + d) for _ in range(k)]
        terms[-1] = max(2, terms[-1])
        x = Fraction(terms[-1])
        for t in reversed(terms[:-1]):
            x = t + 1 / x
        return (f"Write {x.numerator}/{x.denominator} as a simple continued fraction [a0; a1, ..., ak] "
                f"and list a0 a1 ... ak separated by spaces.", terms, {"value": f"{x.numerator}/{x.denominator}"})

    def format_answer(self, answer):
        return fmt_list(answer)

    def parse(self, text, problem):
        v = parse_int_list(text)
        if not v or len(v) > 5000:
            raise ParseError("expected a list of integers")
        return v

    def grade(self, problem, value):
        if any(t <= 0 for t in value[1:]):
            return INVALID
        x = Fraction(value[-1])
        for t in reversed(value[:-1]):
            if x == 0:
                return INVALID
            x = t + 1 / x
        return 1.0 if x == Fraction(problem.meta["value"]) else 0.0

    def wrong_answers(self, problem):
        a = problem.answer
        return [fmt_list(a[:-1] + [a[-1] + 1]), fmt_list(a[::-1]) if a != a[::-1] else fmt_list(a + [3]),
                fmt_list(a[:1] + [0] + a[1:])]


@register("gym/prime_count")
class PrimeCount(IntAnswer):
    family, description = F, "Number of primes up to n."

    def build(self, rng, d):
        # 1.3^d up to difficulty 30 (n <= 157k), then linear (n <= 14M at 100): the sieve of 1.3^100 ran out of memory
        n = rng.randint(grow_until(30, d, 30, 10 ** 5, 1.3), grow_until(60, d, 30, 2 * 10 ** 5, 1.3))
        sieve = bytearray([1]) * (n + 1)
        sieve[0:2] = b"\0\0"
        for i in range(2, math.isqrt(n) + 1):
            if sieve[i]:
                sieve[i * i::i] = bytearray(len(range(i * i, n + 1, i)))
        return f"How many prime numbers are less than or equal to {n}?", sum(sieve)


def discrete_log(g: int, h: int, p: int) -> int | None:
    """Smallest x >= 0 with g^x = h (mod p), by baby-step giant-step."""
    m = math.isqrt(p) + 1
    table: dict[int, int] = {}
    e = 1
    for j in range(m):
        table.setdefault(e, j)
        e = e * g % p
    step = pow(g, -m, p)
    y = h % p
    for i in range(m + 1):
        if y in table:
            return i * m + table[y]
        y = y * step % p
    return None


@register("gym/discrete_log")
class DiscreteLog(IntAnswer):
    family, description = F, "Smallest exponent x with g^x = h mod p."

    def build(self, rng, d):
        # 1.5^d up to difficulty 30 (p <= 1.2e7), then linear (p <= 3.6e8 at 100: baby-step giant-step in sqrt p)
        p = random_prime(rng, grow_until(20, d, 30, 2 * 10 ** 6, 1.5), grow_until(60, d, 30, 5 * 10 ** 6, 1.5))
        g = rng.randint(2, p - 1)
        h = pow(g, rng.randint(1, p - 2), p)
        return f"Find the smallest non-negative integer x with {g}^x = {h} (mod {p}).", discrete_log(g, h, p)


@register("gym/sqrt_mod")
class SqrtMod(GymEnv):
    family, description = F, "Both square roots of a quadratic residue modulo an odd prime."

    def build(self, rng, d):
        p = random_prime(rng, grow(11, d, 1.6), grow(40, d, 1.6))
        r = rng.randint(1, p - 1)
        a = r * r % p
        return (f"Find all x in [0, {p - 1}] with x^2 = {a} (mod {p}). List them in increasing order, separated "
                f"by spaces.", sorted({r, p - r}), {"p": p, "a": a})

    def format_answer(self, answer):
        return fmt_list(answer)

    def parse(self, text, problem):
        v = parse_int_list(text)
        if len(v) > 10:
            raise ParseError("too many values")
        return v

    def grade(self, problem, value):
        p, a = problem.meta["p"], problem.meta["a"]
        if len(set(value)) != len(value) or any(not 0 <= x < p for x in value):
            return INVALID
        good = [x for x in value if x * x % p == a]
        return 1.0 if len(good) == len(value) == 2 else 0.0

    def wrong_answers(self, problem):
        r1, r2 = problem.answer
        return [str(r1), f"{r1} {r2} {(r1 + 1) % problem.meta['p']}", f"{r1} {r1}", f"{r1 + 1} {r2}"]


@register("gym/factorial_trailing_zeros")
class FactorialTrailingZeros(IntAnswer):
    family, description = F, "Trailing zeros of n! written in base b."

    def build(self, rng, d):
        n, b = rng.randint(10, grow(50, d, 1.6)), rng.choice([6, 8, 10, 12, 14, 15, 18, 20, 24, 36])

        def leg(p):
            s, q = 0, p
            while q <= n:
                s, q = s + n // q, q * p
            return s

        z = min(leg(p) // e for p, e in factorize(b).items())
        return f"How many trailing zeros does {n}! have when written in base {b}?", z


@register("gym/floor_sum")
class FloorSum(IntAnswer):
    family, description = F, "Sum of floor(n/i) for i = 1..n."

    def build(self, rng, d):
        # n ~ 1.8^d up to difficulty 40 (~10^11.5), then quadratic in d (~10^13 at 100): the exact sum takes
        # O(sqrt n) steps (2.5 s at difficulty 50 and 1.8^d, hours at 100)
        lo, hi = grow(10, min(d, 40), 1.8), grow(30, min(d, 40), 1.8)
        if d > 40:
            lo, hi = lo * (d - 30) ** 2 // 100, hi * (d - 30) ** 2 // 100
        n = rng.randint(lo, hi)
        # the sum counts the pairs (i, j) with i * j <= n: by symmetry about i = j, twice those with i <= sqrt(n),
        # less the r * r counted twice
        r = math.isqrt(n)
        total = 2 * sum(map(n.__floordiv__, range(1, r + 1))) - r * r
        return f"Compute the sum of floor({n}/i) over i = 1, 2, ..., {n}.", total


@register("gym/multiplicative_order")
class MultiplicativeOrder(IntAnswer):
    family, description = F, "Multiplicative order of a modulo a prime p."

    def build(self, rng, d):
        # 1.7^d up to difficulty 30 (p <= 4.9e8), then linear (p <= 2e10 at 100): p - 1 is factored by trial division
        p = random_prime(rng, grow_until(20, d, 30, 10 ** 8, 1.7), grow_until(60, d, 30, 3 * 10 ** 8, 1.7))
        a = rng.randint(2, p - 1)
        o = p - 1
        for q in factorize(p - 1):
            while o % q == 0 and pow(a, o // q, p) == 1:
                o //= q
        return f"What is the smallest positive integer k with {a}^k = 1 (mod {p})?", o


@register("gym/power_tower_mod")
class PowerTowerMod(IntAnswer):
    family, description = F, "a^(b^c) modulo m."

    def build(self, rng, d):
        a, b, c = rng.randint(2, 20 + d), rng.randint(2, 10 + d), rng.randint(2, 4 + d // 2)
        m = rng.randint(10 ** (1 + d // 3), 10 ** (2 + d // 3))
        return f"Compute {a}^({b}^{c}) mod {m}.", pow(a, b ** c, m)
