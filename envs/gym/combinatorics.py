"""Combinatorics and counting (large counts are asked modulo 10^9+7)."""
from __future__ import annotations

import math
from collections import Counter

from envs.base import register
from envs.gym._util import MOD, IntAnswer, ListAnswer, fmt_list, grow, grow_until, random_prime

F = "combinatorics"
MODTXT = "Give the answer modulo 1000000007."


@register("gym/binomial_mod_p")
class BinomialModP(IntAnswer):
    family, description = F, "Binomial coefficient C(n, k) modulo a small prime (Lucas)."

    def build(self, rng, d):
        p = random_prime(rng, 3, 13 + 6 * d)
        n = rng.randint(p, p ** (2 + d // 3))
        if rng.random() < 0.75:
            # a k drawn from 0..n has a base-p digit above n's almost always, where C(n, k) = 0 (Lucas): 0 was the
            # answer of 61-100% of the problems from difficulty 5. Each digit of k drawn up to n's: not 0
            k, place, nn = 0, 1, n
            while nn:
                k, place, nn = k + rng.randint(0, nn % p) * place, place * p, nn // p
        else:
            k = rng.randint(0, n)
        r, nn, kk = 1, n, k
        while nn or kk:
            r = r * math.comb(nn % p, kk % p) % p
            nn, kk = nn // p, kk // p
        return f"Compute the binomial coefficient C({n}, {k}) modulo {p}.", r


@register("gym/catalan")
class Catalan(IntAnswer):
    family, description = F, "Catalan numbers (balanced bracket sequences)."

    def build(self, rng, d):
        # 1.3^d to difficulty 30 (10540), then linear (difficulty 0 has 3 problems: the first rung of the ladder, which
        # the tiny cascade's RLVE stage climbs; a held-out problem there is also drawn for training, and counted)
        n = rng.randint(2 + d, grow_until(4, d, 30, 2000, 1.3, 2))
        top = 1  # C(2n, n) / (n + 1) = (2n)! / (n! (n + 1)!), modulo the prime: O(n) small products, where
        for i in range(n + 2, 2 * n + 1):  # the exact bigint grew with n (minutes at difficulty 50)
            top = top * i % MOD
        bottom = 1
        for i in range(2, n + 1):
            bottom = bottom * i % MOD
        return (f"How many balanced strings of {n} pairs of parentheses are there? {MODTXT}",
                top * pow(bottom, MOD - 2, MOD) % MOD)


@register("gym/derangements")
class Derangements(IntAnswer):
    family, description = F, "Number of permutations with no fixed point."

    def build(self, rng, d):
        n = rng.randint(3 + d, grow_until(5, d, 30, 2000, 1.3, 2))  # O(n): 1.3^d to difficulty 30, then linear
        a, b = 1, 0  # D0, D1
        for i in range(2, n + 1):
            a, b = b, (i - 1) * (a + b) % MOD
        return f"How many permutations of {n} elements have no fixed point? {MODTXT}", (b if n >= 1 else a) % MOD


@register("gym/bounded_compositions")
class BoundedCompositions(IntAnswer):
    family, description = F, "Stars and bars with upper bounds: solutions of x1+...+xk = n, 0 <= xi <= ui."

    def build(self, rng, d):
        k = rng.randint(2, 3 + d // 2)
        us = [rng.randint(1, 4 + 2 * d) for _ in range(k)]
        n = rng.randint(0, sum(us))
        ways = [1] + [0] * n
        for u in us:
            nxt = [0] * (n + 1)
            for s, w in enumerate(ways):
                if w:
                    for x in range(min(u, n - s) + 1):
                        nxt[s + x] += w
            ways = nxt
        cons = ", ".join(f"0 <= x{i + 1} <= {u}" for i, u in enumerate(us))
        return (f"How many integer solutions does x1 + ... + x{k} = {n} have with {cons}? {MODTXT}",
                ways[n] % MOD)


@register("gym/lattice_paths_obstacles")
class LatticePathsObstacles(IntAnswer):
    family, description = F, "Monotone lattice paths in a grid avoiding blocked cells."

    def build(self, rng, d):
        r, c = rng.randint(2, 3 + d), rng.randint(2, 3 + d)
        blocked = {(rng.randrange(r), rng.randrange(c)) for _ in range((r * c) // 6)} - {(0, 0), (r - 1, c - 1)}
        ways = [[0] * c for _ in range(r)]
        for i in range(r):
            for j in range(c):
                if (i, j) in blocked:
                    continue
                ways[i][j] = 1 if (i, j) == (0, 0) else ((ways[i - 1][j] if i else 0) + (ways[i][j - 1] if j else 0))
        grid = "\n".join("".join("#" if (i, j) in blocked else "." for j in range(c)) for i in range(r))
        return (f"In the grid below ('#' is blocked), count the paths from the top-left cell to the bottom-right "
                f"cell that only move right or down through open cells. {MODTXT}\n{grid}", ways[-1][-1] % MOD)


@register("gym/partitions_at_most_k")
class PartitionsAtMostK(IntAnswer):
    family, description = F, "Integer partitions of n into at most k parts."

    def build(self, rng, d):
        n = rng.randint(4 + d, 8 + 3 * d + d * d // 4)  # polynomial: the O(n k) DP stays under a second to d ~ 80
        k = rng.randint(2, n)
        p = [1] + [0] * n  # partitions with parts <= k (conjugate of at most k parts)
        for part in range(1, k + 1):
            for s in range(part, n + 1):
                p[s] = (p[s] + p[s - part]) % MOD  # (mod as it goes: the exact counts grow huge)
        return f"In how many ways can {n} be written as a sum of at most {k} positive integers, ignoring order? {MODTXT}", p[n] % MOD


@register("gym/stirling2")
class Stirling2(IntAnswer):
    family, description = F, "Stirling numbers of the second kind (set partitions into k blocks)."

    def build(self, rng, d):
        n = rng.randint(3 + d, 5 + 2 * d + d * d // 8)  # polynomial: the O(n k) table stays small
        # k = 1 or n (answer 1) was 2/n of the draws: 49% of difficulty 0 answered by "1"
        k = rng.randint(2, n - 1) if rng.random() < 0.9 else rng.choice([1, n])
        s = [[0] * (k + 1) for _ in range(n + 1)]
        s[0][0] = 1
        for i in range(1, n + 1):
            for j in range(1, k + 1):
                s[i][j] = (j * s[i - 1][j] + s[i - 1][j - 1]) % MOD
        return (f"In how many ways can a set of {n} labelled elements be partitioned into exactly {k} non-empty "
                f"unlabelled blocks? {MODTXT}", s[n][k] % MOD)


@register("gym/stirling1")
class Stirling1(IntAnswer):
    family, description = F, "Unsigned Stirling numbers of the first kind (permutations with k cycles)."

    def build(self, rng, d):
        n = rng.randint(3 + d, 5 + 2 * d + d * d // 8)  # polynomial: the O(n k) table stays small
        k = rng.randint(1, n)
        c = [[0] * (k + 1) for _ in range(n + 1)]
        c[0][0] = 1
        for i in range(1, n + 1):
            for j in range(1, k + 1):
                c[i][j] = ((i - 1) * c[i - 1][j] + c[i - 1][j - 1]) % MOD
        return f"How many permutations of {n} elements have exactly {k} cycles? {MODTXT}", c[n][k] % MOD


@register("gym/necklaces")
class Necklaces(IntAnswer):
    family, description = F, "Necklaces up to rotation (Burnside's lemma)."

    def build(self, rng, d):
        n, k = rng.randint(3, 5 + 2 * d), rng.randint(2, 3 + d // 2)
        total = sum(k ** math.gcd(i, n) for i in range(n)) // n
        return (f"How many distinct necklaces of {n} beads can be made with beads of {k} colours, where two "
                f"necklaces are the same if one is a rotation of the other? {MODTXT}", total % MOD)


@register("gym/word_arrangements")
class WordArrangements(IntAnswer):
    family, description = F, "Distinct arrangements of the letters of a word (multinomial)."

    def build(self, rng, d):
        alpha = "ABCDEFGHIJKLMNOP"[: 2 + d // 2]
        # up to 1.2^d letters to difficulty 30 (1484), then 40 more per level (4284 at 100): 170k-letter prompts and
        # seconds of bigint factorials at difficulty 60
        w = "".join(rng.choice(alpha) for _ in range(rng.randint(4 + d, grow_until(6, d, 30, 40, 1.2, 2))))
        fact = factorials_mod(len(w))
        cnt = fact[len(w)]
        for v in Counter(w).values():
            cnt = cnt * pow(fact[v], MOD - 2, MOD) % MOD
        return f"How many distinct strings can be formed by rearranging all the letters of {w}? {MODTXT}", cnt


@register("gym/permutation_rank")
class PermutationRank(IntAnswer):
    family, description = F, "Lexicographic rank of a permutation."

    def build(self, rng, d):
        n = 3 + d
        p = list(range(1, n + 1))
        rng.shuffle(p)
        rank, rest = 0, sorted(p)
        for i, x in enumerate(p):
            j = rest.index(x)
            rank += j * math.factorial(n - 1 - i)
            rest.pop(j)
        return (f"Among all permutations of 1..{n} in lexicographic order, starting with 1 2 ... {n} at position 1, "
                f"at which position is {fmt_list(p)}?", rank + 1)


@register("gym/kth_permutation")
class KthPermutation(ListAnswer):
    family, description = F, "The k-th permutation in lexicographic order."

    def build(self, rng, d):
        n = 3 + d
        k = rng.randint(1, math.factorial(n))
        rest, r, out = list(range(1, n + 1)), k - 1, []
        for i in range(n, 0, -1):
            q, r = divmod(r, math.factorial(i - 1))
            out.append(rest.pop(q))
        return (f"List the permutations of 1..{n} in lexicographic order, numbered from 1. Give permutation number "
                f"{k}, its elements separated by spaces.", out)


@register("gym/inclusion_exclusion")
class InclusionExclusion(IntAnswer):
    family, description = F, "Count integers in [1, N] divisible by at least one of several numbers."

    def build(self, rng, d):
        # to difficulty 30 as before (17 draws, N <= 1.3e9), then a draw per 7 levels and N linear (<= 8.3e9 at 100):
        # the subsets with lcm <= N, walked below, number in the millions for 52 divisors and N ~ 1.6^d
        ds = sorted(set(rng.randint(2, 12 + 3 * d) for _ in range(2 + min(d, 30) // 2 + max(0, d - 30) // 7)))
        n = rng.randint(100, grow_until(1000, d, 30, 10 ** 8, 1.6))
        # a multiple of another listed number adds nothing; subsets are walked only while their lcm is <= n (a
        # larger lcm counts 0, and so does every superset's): 2^len(ds) subsets took minutes past difficulty 30
        base = [x for x in ds if not any(y < x and x % y == 0 for y in ds)]

        def signed(i: int, l: int, sign: int) -> int:
            out = 0
            for j in range(i, len(base)):
                m = math.lcm(l, base[j])
                if m <= n:
                    out += sign * (n // m) + signed(j + 1, m, -sign)
            return out

        return (f"How many integers in [1, {n}] are divisible by at least one of {fmt_list(ds, ', ')}?",
                signed(0, 1, 1))


@register("gym/board_tilings")
class BoardTilings(IntAnswer):
    family, description = F, "Tilings of a 1 x n strip with tiles of given lengths."

    def build(self, rng, d):
        n = rng.randint(5 + d, grow(10, d, 1.3, 3))
        tiles = sorted(set(rng.randint(1, 3 + d // 2) for _ in range(2 + d // 3)))
        # w[i] = sum of w[i - t] over the tiles t: the first max(tiles) terms by the recurrence, the n-th by
        # polynomial powers in O(k^2 log n) (the O(n) table took seconds past difficulty 50, where n ~ 1.3^d)
        k = tiles[-1]
        w = [1] + [0] * (k - 1)
        for i in range(1, k):
            w[i] = sum(w[i - t] for t in tiles if t <= i) % MOD
        coef = [int(j in tiles) for j in range(1, k + 1)]
        return (f"In how many ways can a 1 x {n} strip be tiled with tiles of lengths {fmt_list(tiles, ', ')} "
                f"(unlimited supply; order matters)? {MODTXT}", linear_recurrence_nth(coef, w, n))


@register("gym/bounded_dyck_paths")
class BoundedDyckPaths(IntAnswer):
    family, description = F, "Balanced parenthesis strings with bounded nesting depth."

    def build(self, rng, d):
        # up to 1.2^d pairs to difficulty 40 (7428), then 2000 more per level (127k at 100); the count by reflection
        # (O(n), where the O(n h) walk over the depths took minutes past difficulty 50)
        n = rng.randint(3 + d, grow_until(5, d, 40, 2000, 1.2, 2))
        h = rng.randint(1, max(1, n - 1))
        return (f"How many balanced strings of {n} pairs of parentheses have nesting depth at most {h}? {MODTXT}",
                bounded_dyck_count(n, h))


def factorials_mod(n: int, mod: int = MOD) -> list[int]:
    """``[0!, 1!, ..., n!]`` modulo ``mod``."""
    out = [1] * (n + 1)
    for i in range(2, n + 1):
        out[i] = out[i - 1] * i % mod
    return out


def bounded_dyck_count(n: int, h: int, mod: int = MOD) -> int:
    """Balanced strings of ``n`` pairs with nesting depth at most ``h``, modulo ``mod`` (2n < mod): walks of 2n steps
    +-1 from 0 to 0 that never touch -1 or h + 1. By reflection in both walls (period 2(h + 2)), the sum over integer
    k of C(2n, n + k(h + 2)) - C(2n, n - 1 + k(h + 2))."""
    m = 2 * n
    fact = factorials_mod(m, mod)
    inv = [1] * (m + 1)  # 1 / i! modulo mod
    inv[m] = pow(fact[m], mod - 2, mod)
    for i in range(m, 0, -1):
        inv[i - 1] = inv[i] * i % mod

    def comb(j):  # C(2n, j)
        return fact[m] * inv[j] % mod * inv[m - j] % mod if 0 <= j <= m else 0

    total, p = 0, h + 2
    for k in range(-(n // p) - 1, n // p + 2):
        total += comb(n + k * p) - comb(n - 1 + k * p)
    return total % mod


def linear_recurrence_nth(coef: list[int], init: list[int], n: int, mod: int = MOD) -> int:
    """``a[n]`` modulo ``mod`` for ``a[i] = sum_j coef[j - 1] * a[i - j]`` (j = 1..k) with ``a[0..k-1] = init``:
    x^n modulo the characteristic polynomial x^k - sum_j coef[j - 1] x^(k - j), by squaring (Kitamasa)."""
    k = len(coef)
    if n < k:
        return init[n] % mod

    def mul(p, q):
        r = [0] * (2 * k - 1)
        for i, a in enumerate(p):
            if a:
                for j, b in enumerate(q):
                    r[i + j] += a * b
        for i in range(2 * k - 2, k - 1, -1):  # x^i = x^(i - k) * sum_j coef[j - 1] x^(k - j)
            c = r[i] % mod
            if c:
                for j in range(1, k + 1):
                    r[i - j] += c * coef[j - 1]
        return [x % mod for x in r[:k]]

    result = [1] + [0] * (k - 1)
    base = [coef[0] % mod] if k == 1 else [0, 1] + [0] * (k - 2)
    while n:
        if n & 1:
            result = mul(result, base)
        base = mul(base, base)
        n >>= 1
    return sum(a * b for a, b in zip(result, init)) % mod
