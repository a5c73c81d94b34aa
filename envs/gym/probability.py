"""Probability and expectation; answers are exact fractions p/q."""
from __future__ import annotations

import math
from fractions import Fraction

from envs.base import register
from envs.gym._util import FracAnswer, frac_str, grow_until, random_connected_graph

F = "probability"
FMT = "Give the exact answer as a reduced fraction p/q (or an integer)."


def solve(a, b):
    """Solve the linear system a x = b exactly (a is square and non-singular)."""
    n = len(a)
    m = [[Fraction(x) for x in row] + [Fraction(y)] for row, y in zip(a, b)]
    for c in range(n):
        p = next(r for r in range(c, n) if m[r][c] != 0)
        m[c], m[p] = m[p], m[c]
        inv = 1 / m[c][c]
        m[c] = [x * inv for x in m[c]]
        for r in range(n):
            if r != c and m[r][c]:
                f = m[r][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [row[-1] for row in m]


def solve_integer(a, b):
    """Solve ``a x = b`` exactly for an integer, non-singular ``a`` and integer ``b``: fraction-free (Bareiss)
    elimination keeps every entry an integer (each division is exact), then back substitution in fractions. Twenty
    times faster than :func:`solve` in fractions, whose gcds dominate (9 s at 213 unknowns)."""
    n = len(a)
    m = [list(row) + [y] for row, y in zip(a, b)]
    prev = 1
    for c in range(n):
        p = next(r for r in range(c, n) if m[r][c])
        m[c], m[p] = m[p], m[c]
        pivot, top = m[c][c], m[c]
        for r in range(c + 1, n):
            f = m[r][c]
            m[r] = [(pivot * x - f * y) // prev for x, y in zip(m[r], top)] if f else [pivot * x // prev for x in m[r]]
        prev = pivot
    x = [Fraction(0)] * n
    for c in range(n - 1, -1, -1):
        x[c] = Fraction(m[c][n] - sum(m[c][j] * x[j] for j in range(c + 1, n)), m[c][c])
    return x


def dice_dist(n, s):
    dist = {0: 1}
    for _ in range(n):
        nxt: dict[int, int] = {}
        for t, w in dist.items():
            for f in range(1, s + 1):
                nxt[t + f] = nxt.get(t + f, 0) + w
        dist = nxt
    return dist


@register("gym/dice_sum_probability")
class DiceSumProbability(FracAnswer):
    family, description = F, "Probability that n fair dice sum to t."

    def build(self, rng, d):
        n, s = rng.randint(2, 2 + d // 2), rng.choice([4, 6, 6, 8, 10, 12, 20])
        t = rng.randint(n + (n * (s - 1)) // 4, n * s - (n * (s - 1)) // 4)
        return (f"{n} fair {s}-sided dice (faces 1..{s}) are rolled. What is the probability that their sum is exactly "
                f"{t}? {FMT}", frac_str(Fraction(dice_dist(n, s)[t], s ** n)))


@register("gym/expected_max_dice")
class ExpectedMaxDice(FracAnswer):
    family, description = F, "Expected maximum of n fair dice."

    def build(self, rng, d):
        n, s = rng.randint(2, 3 + d), rng.randint(4, 8 + 2 * d)  # (2 + d and 6 + 2d: three problems at difficulty 0)
        e = sum(Fraction(k ** n - (k - 1) ** n, s ** n) * k for k in range(1, s + 1))
        return f"{n} fair {s}-sided dice are rolled. What is the expected value of the largest face shown? {FMT}", frac_str(e)


@register("gym/binomial_at_least")
class BinomialAtLeast(FracAnswer):
    family, description = F, "P(X >= k) for a binomial random variable."

    def build(self, rng, d):
        n = rng.randint(3, 4 + d)
        q = rng.randint(2, 4 + d // 2)
        p = Fraction(rng.randint(1, q - 1), q)
        k = rng.randint(1, n)
        pr = sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))
        return (f"A biased coin shows heads with probability {p.numerator}/{p.denominator}. It is tossed {n} times. "
                f"What is the probability of at least {k} heads? {FMT}", frac_str(pr))


@register("gym/markov_absorption")
class MarkovAbsorption(FracAnswer):
    family, description = F, "Absorption probability of a finite Markov chain."

    def build(self, rng, d):
        # transient states 0..n-1, absorbing A and B: one more per 2 levels to difficulty 30, then per 7 (the n x n
        # table of weights was 50k characters at difficulty 100 with n = 53)
        n = 3 + min(d, 30) // 2 + max(0, d - 30) // 7
        q = rng.randint(2, 4 + d // 3)
        rows = []
        for _ in range(n):
            w = [rng.randint(0, q) for _ in range(n + 2)]
            w[n + rng.randrange(2)] += 1  # every state can be absorbed directly
            rows.append([Fraction(x, sum(w)) for x in w])
        names = [str(i) for i in range(n)] + ["A", "B"]
        text = "\n".join(f"from {i}: " + ", ".join(f"to {names[j]} w.p. {frac_str(p)}" for j, p in enumerate(r) if p)
                         for i, r in enumerate(rows))
        s = rng.randrange(n)
        a = [[(1 if i == j else 0) - rows[i][j] for j in range(n)] for i in range(n)]
        x = solve(a, [rows[i][n] for i in range(n)])
        return (f"A Markov chain has transient states 0..{n - 1} and absorbing states A and B, with transitions:\n"
                f"{text}\nStarting in state {s}, what is the probability of being absorbed in A? {FMT}", frac_str(x[s]))


@register("gym/expected_hitting_time")
class ExpectedHittingTime(FracAnswer):
    family, description = F, "Expected steps of a random walk on a graph to reach a target."

    def build(self, rng, d):
        # exponential up to difficulty 40 (106 vertices), then one vertex per level (166 at 100)
        n = grow_until(4, d, 40, 1, 1.08, 0.5)
        edges = random_connected_graph(rng, n, int(n * 1.4))
        adj = [[] for _ in range(n)]
        for u, v in edges:
            adj[u].append(v)
            adj[v].append(u)
        s, t = rng.sample(range(n), 2)
        idx = [v for v in range(n) if v != t]
        pos = {v: i for i, v in enumerate(idx)}
        a = [[0] * len(idx) for _ in idx]  # deg(v) E[v] - sum of E[w] over the neighbours w != t = deg(v)
        for v in idx:
            a[pos[v]][pos[v]] = len(adj[v])
            for w in adj[v]:
                if w != t:
                    a[pos[v]][pos[w]] -= 1
        x = solve_integer(a, [len(adj[v]) for v in idx])
        shown = ", ".join(f"{u}-{v}" for u, v in edges)
        return (f"A walker moves on the undirected graph with vertices 0..{n - 1} and edges {shown}; at each step it "
                f"moves to a uniformly random neighbour. Starting at {s}, what is the expected number of steps until it "
                f"first reaches {t}? {FMT}", frac_str(x[pos[s]]))


@register("gym/hypergeometric")
class Hypergeometric(FracAnswer):
    family, description = F, "Drawing without replacement: probability of exactly k red balls."

    def build(self, rng, d):
        r, b = rng.randint(2, 4 + 2 * d), rng.randint(2, 4 + 2 * d)
        m = rng.randint(2, r + b - 1)
        k = rng.randint(max(0, m - b), min(r, m))
        pr = Fraction(math.comb(r, k) * math.comb(b, m - k), math.comb(r + b, m))
        return (f"An urn holds {r} red and {b} blue balls. {m} balls are drawn without replacement. What is the "
                f"probability that exactly {k} of them are red? {FMT}", frac_str(pr))


@register("gym/coupon_collector")
class CouponCollector(FracAnswer):
    family, description = F, "Expected draws to see m distinct coupons out of n."

    def build(self, rng, d):
        n = rng.randint(3, 5 + 3 * d)
        m = rng.randint(2, n)
        e = sum(Fraction(n, n - i) for i in range(m))
        return (f"Each draw gives one of {n} coupon types uniformly at random. What is the expected number of draws "
                f"until {m} different types have been seen? {FMT}", frac_str(e))


@register("gym/birthday_collision")
class BirthdayCollision(FracAnswer):
    family, description = F, "Probability that some two of k people share a birthday among n days."

    def build(self, rng, d):
        n = rng.randint(5, 10 + 5 * d)
        k = rng.randint(2, min(n, 3 + d))
        p_distinct = Fraction(math.perm(n, k), n ** k)
        return (f"Each of {k} people has a birthday chosen uniformly at random from {n} days. What is the probability "
                f"that at least two share a birthday? {FMT}", frac_str(1 - p_distinct))


@register("gym/bayes_test")
class BayesTest(FracAnswer):
    family, description = F, "Posterior probability after repeated independent diagnostic tests (Bayes)."

    def build(self, rng, d):
        prior = Fraction(1, rng.randint(2, 20 + 10 * d))
        sens = Fraction(rng.randint(6, 9), 10)
        fpr = Fraction(rng.randint(1, 3), 10 * rng.randint(1, 1 + d // 3))
        k = rng.randint(1, 1 + d // 3)
        num = prior * sens ** k
        post = num / (num + (1 - prior) * fpr ** k)
        return (f"A condition has prevalence {frac_str(prior)}. A test is positive with probability {frac_str(sens)} "
                f"if the condition is present and {frac_str(fpr)} if it is absent, independently on each repetition. "
                f"A person tests positive {k} time(s) in a row. What is the probability that they have the condition? "
                f"{FMT}", frac_str(post))
