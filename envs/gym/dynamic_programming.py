"""Dynamic programming: knapsacks, subsequences, partitions, intervals, trees and bitmasks."""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from functools import lru_cache

from envs.base import register
from envs.gym._util import (
    INVALID, MOD, GymEnv, IntAnswer, balanced, fmt_list, grow, grow_until, parse_int_list, random_tree,
)

F = "dynamic_programming"


def _n(d, base=5, per_level=6):
    """1.1^d up to difficulty 30, then ``per_level`` more per level: the O(n^2) tables and the prompts of the
    exponential sizes took minutes, or filled megabytes (250k-character prompts), at difficulty 100."""
    return grow_until(base, d, 30, per_level)


def _word(rng, n, alpha="abc"):
    return "".join(rng.choice(alpha) for _ in range(n))


@register("gym/knapsack_01")
class Knapsack01(IntAnswer):
    family, description = F, "0/1 knapsack: maximum total value within a weight capacity."

    def build(self, rng, d):
        # items grow exponentially up to difficulty 30 (117 items), then 2 per level: the O(n * capacity) table, with
        # the capacity ~ n * d / 4, took 6 s at difficulty 60 and minutes past it (257 items at 100: under a second)
        n = grow_until(5, d, 30, 2)
        items = [(rng.randint(1, 10 + d), rng.randint(1, 20 + 2 * d)) for _ in range(n)]
        cap = sum(w for w, _ in items) // 2
        best = [0] * (cap + 1)
        for w, v in items:
            if w <= cap:  # each cell from the previous row's values: every item taken at most once
                best[w:] = list(map(max, best[w:], [x + v for x in best[:cap + 1 - w]]))
        shown = ", ".join(f"(weight {w}, value {v})" for w, v in items)
        return f"Items: {shown}. Each item can be taken at most once. What is the maximum total value with total weight at most {cap}?", best[cap]


@register("gym/longest_increasing_subsequence")
class LongestIncreasingSubsequence(GymEnv):
    family, description = F, "Give a longest strictly increasing subsequence (any one)."

    def build(self, rng, d):
        xs = [rng.randint(0, 20 + 5 * d) for _ in range(_n(d, 6, 8))]
        n = len(xs)
        best, prev = [1] * n, [-1] * n
        for i in range(n):
            for j in range(i):
                if xs[j] < xs[i] and best[j] + 1 > best[i]:
                    best[i], prev[i] = best[j] + 1, j
        i = max(range(n), key=lambda k: best[k])
        seq = []
        while i >= 0:
            seq.append(xs[i])
            i = prev[i]
        return (f"Give a longest strictly increasing subsequence of {fmt_list(xs)} (its values in order, separated by "
                f"spaces).", seq[::-1], {"xs": xs})

    def format_answer(self, answer):
        return fmt_list(answer)

    def parse(self, text, problem):
        return parse_int_list(text)

    def grade(self, problem, value):
        it = iter(problem.meta["xs"])
        if not all(a < b for a, b in zip(value, value[1:])) or not all(any(x == y for y in it) for x in value):
            return INVALID
        return (len(value) / len(problem.answer)) ** 5

    def wrong_answers(self, problem):
        a = problem.answer
        return [fmt_list(a[:-1]) if len(a) > 1 else "", fmt_list(a[::-1]) if len(a) > 1 else fmt_list(a * 2),
                fmt_list(a + [10 ** 6, 10 ** 6 + 1])]


def lcs(a, b):
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


@register("gym/lcs_length")
class LCSLength(IntAnswer):
    family, description = F, "Length of the longest common subsequence of two strings."

    def build(self, rng, d):
        a, b = _word(rng, _n(d, 6), "abcd"), _word(rng, _n(d, 6), "abcd")
        return f"What is the length of the longest common subsequence of '{a}' and '{b}'?", lcs(a, b)


@register("gym/edit_distance")
class EditDistance(IntAnswer):
    family, description = F, "Levenshtein distance between two strings."

    def build(self, rng, d):
        a = _word(rng, _n(d, 5, 8), "abcde")
        b = list(a)
        # a number of edits drawn from a range, not 1 + d // 2 of them, and none a no-op (a substitution by the same
        # letter, a deletion past the end): the distance is at most the number of edits and mostly equal to it, so 1
        # was the answer of 82-85% of the problems at difficulties 0-1, 2 of 67% at 2
        for _ in range(rng.randint(1 + d // 4, 3 + d // 2)):
            op = rng.randrange(3) if b else 0
            if op == 0:
                b.insert(rng.randrange(len(b) + 1), rng.choice("abcde"))
            else:
                i = rng.randrange(len(b))
                if op == 1:
                    b.pop(i)
                else:
                    b[i] = rng.choice("abcde".replace(b[i], ""))
        b = "".join(b)
        prev = list(range(len(b) + 1))
        for i, x in enumerate(a, 1):
            cur = [i]
            for j, y in enumerate(b, 1):
                cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
            prev = cur
        return (f"What is the minimum number of single-character insertions, deletions and substitutions that turn "
                f"'{a}' into '{b}'?", prev[-1])


@register("gym/coin_change_min")
class CoinChangeMin(IntAnswer):
    family, description = F, "Fewest coins summing to an amount (-1 if impossible)."

    def build(self, rng, d):
        # -1 (impossible) was the answer of 36-41% at difficulties 0-1: such draws are mostly drawn again
        return balanced(rng, lambda: self._draw(rng, d), lambda ans: ans == -1)

    def _draw(self, rng, d):
        coins = sorted(set(rng.randint(2, 10 + 3 * d) for _ in range(2 + d // 2)))
        amt = rng.randint(10, 30 + 15 * d)
        inf = float("inf")
        best = [0] + [inf] * amt
        for a in range(1, amt + 1):
            best[a] = min((best[a - c] + 1 for c in coins if c <= a), default=inf)
        return (f"Using coins of values {fmt_list(coins, ', ')} (unlimited supply), what is the fewest number of coins "
                f"that sum to exactly {amt}? Answer -1 if impossible.", -1 if best[amt] == inf else best[amt])


@register("gym/coin_change_ways")
class CoinChangeWays(IntAnswer):
    family, description = F, "Number of coin combinations (order ignored) making an amount."

    def build(self, rng, d):
        coins = sorted(set(rng.randint(1, 8 + 3 * d) for _ in range(2 + d // 2)))
        amt = rng.randint(10, 30 + 20 * d)
        ways = [1] + [0] * amt
        for c in coins:
            for a in range(c, amt + 1):
                ways[a] += ways[a - c]
        return (f"In how many ways can {amt} be made from coins of values {fmt_list(coins, ', ')} (unlimited supply, "
                f"order does not matter)? Give the answer modulo 1000000007.", ways[amt] % MOD)


@register("gym/matrix_chain")
class MatrixChain(IntAnswer):
    family, description = F, "Minimum scalar multiplications for a matrix chain product."

    def build(self, rng, d):
        # exponential up to difficulty 30 (99 dimensions), then 2 per level: the O(n^3) table took 4 s at difficulty
        # 50 (519 dimensions) and minutes past it
        dims = [rng.randint(2, 10 + 3 * d) for _ in range(grow_until(4, d, 30, 2))]
        n = len(dims) - 1
        c = [[0] * n for _ in range(n)]
        for ln in range(2, n + 1):
            for i in range(n - ln + 1):
                j = i + ln - 1
                c[i][j] = min(c[i][k] + c[k + 1][j] + dims[i] * dims[k + 1] * dims[j + 1] for k in range(i, j))
        shown = ", ".join(f"{dims[i]}x{dims[i + 1]}" for i in range(n))
        return (f"Matrices of sizes {shown} are multiplied in this order. What is the minimum number of scalar "
                f"multiplications over all parenthesisations?", c[0][n - 1])


@register("gym/max_subarray")
class MaxSubarray(IntAnswer):
    family, description = F, "Maximum sum of a non-empty contiguous subarray (Kadane)."

    def build(self, rng, d):
        xs = [rng.randint(-20 - d, 15 + d) for _ in range(_n(d, 6))]
        best = cur = xs[0]
        for x in xs[1:]:
            cur = max(x, cur + x)
            best = max(best, cur)
        return f"What is the maximum sum of a non-empty contiguous subarray of {fmt_list(xs)}?", best


@register("gym/rod_cutting")
class RodCutting(IntAnswer):
    family, description = F, "Maximum revenue from cutting a rod."

    def build(self, rng, d):
        n = _n(d, 4, 8)
        price = [0]
        for i in range(1, n + 1):
            price.append(price[-1] + rng.randint(0, 5 + d))
        best = [0] * (n + 1)
        for L in range(1, n + 1):
            best[L] = max(price[i] + best[L - i] for i in range(1, L + 1))
        shown = ", ".join(f"length {i}: {price[i]}" for i in range(1, n + 1))
        return f"A rod of length {n} can be cut into integer pieces sold at prices {shown}. What is the maximum revenue?", best[n]


@register("gym/grid_max_path")
class GridMaxPath(IntAnswer):
    family, description = F, "Maximum-sum monotone path in a weighted grid."

    def build(self, rng, d):
        # exponential up to difficulty 30 (45 x 45), then a row and a column per 3 levels (68 x 68 at 100): the
        # grid alone was 318k characters at difficulty 60
        r = c = grow_until(3, d, 30, 1 / 3, 1.08, 0.5)
        g = [[rng.randint(-5, 9 + d) for _ in range(c)] for _ in range(r)]
        best = [[0] * c for _ in range(r)]
        for i in range(r):
            for j in range(c):
                prev = [best[i - 1][j]] * (i > 0) + [best[i][j - 1]] * (j > 0)
                best[i][j] = g[i][j] + (max(prev) if prev else 0)
        rows = "\n".join(fmt_list(row) for row in g)
        return (f"Moving only right or down from the top-left to the bottom-right cell of this grid, what is the maximum "
                f"possible sum of the visited cells (both ends included)?\n{rows}", best[-1][-1])


@register("gym/longest_palindromic_subsequence")
class LongestPalindromicSubsequence(IntAnswer):
    family, description = F, "Length of the longest palindromic subsequence."

    def build(self, rng, d):
        s = _word(rng, _n(d, 6, 8), "abcd")
        return f"What is the length of the longest palindromic subsequence of '{s}'?", lcs(s, s[::-1])


@register("gym/subset_sum")
class SubsetSum(GymEnv):
    family, description = F, "Find a subset with a given sum (any valid subset)."

    def build(self, rng, d):
        xs = [rng.randint(1, 20 + 10 * d) for _ in range(_n(d, 5))]
        pick = sorted(rng.sample(range(len(xs)), rng.randint(1, len(xs) - 1)))
        t = sum(xs[i] for i in pick)
        return (f"The numbers are {fmt_list(xs)} (indexed from 0). Give the indices of a subset whose sum is exactly "
                f"{t}, in increasing order, separated by spaces.", pick, {"xs": xs, "t": t})

    def format_answer(self, answer):
        return fmt_list(answer)

    def parse(self, text, problem):
        return parse_int_list(text)

    def grade(self, problem, value):
        xs = problem.meta["xs"]
        if len(set(value)) != len(value) or any(not 0 <= i < len(xs) for i in value):
            return INVALID
        return 1.0 if sum(xs[i] for i in value) == problem.meta["t"] else 0.0

    def wrong_answers(self, problem):
        a, xs = problem.answer, problem.meta["xs"]
        rest = [i for i in range(len(xs)) if i not in a]
        return [fmt_list(a + a[:1]), fmt_list(rest) if sum(xs) != 2 * problem.meta["t"] else "0 0",
                fmt_list(a + [len(xs)])]


PARTITION_MAX_COUNT = 30


def min_partition_diff(xs) -> int:
    """Smallest |sum(A) - sum(B)| over the splits of ``xs`` into two groups, by meet in the middle: for each subset sum
    ``a`` of the first half, the sums of the second half nearest ``s / 2 - a`` (2^(n/2) sums a side, whatever the
    size of the numbers)."""
    def sums(part):
        out = {0}
        for x in part:
            out |= {t + x for t in out}
        return out

    s, half = sum(xs), len(xs) // 2
    right = sorted(sums(xs[half:]))
    best = s
    for a in sums(xs[:half]):
        i = bisect_left(right, (s - 2 * a) // 2)
        for b in right[max(0, i - 1):i + 2]:
            best = min(best, abs(s - 2 * (a + b)))
        if best == s % 2:  # no split does better than the parity of the sum
            break
    return best


@register("gym/partition_min_diff")
class PartitionMinDiff(IntAnswer):
    family, description = F, "Split numbers into two groups with minimum sum difference."

    def build(self, rng, d):
        # n numbers below 20 + 5d made 2^n subset sums over a range of ~n^2 d: from difficulty 6 a perfect split was
        # always there and the answer was the parity of the sum. Numbers up to 2^size (size the count the level
        # would have) leave about as many subset sums as values, so the best split is rarely perfect; the count
        # stops at PARTITION_MAX_COUNT (meet in the middle: 2^15 sums a side), the numbers keep growing
        size = _n(d, 4, 8)
        xs = [rng.randint(1, max(20 + 5 * d, 2 ** size)) for _ in range(min(size, PARTITION_MAX_COUNT))]
        return (f"Split the numbers {fmt_list(xs)} into two groups (every number in exactly one group). What is the "
                f"minimum possible absolute difference between the group sums?", min_partition_diff(xs))


@register("gym/house_robber_circle")
class HouseRobberCircle(IntAnswer):
    family, description = F, "Maximum sum of non-adjacent elements arranged in a circle."

    def build(self, rng, d):
        xs = [rng.randint(1, 20 + 3 * d) for _ in range(_n(d, 5))]

        def line(a):
            take = skip = 0
            for x in a:
                take, skip = skip + x, max(take, skip)
            return max(take, skip)

        return (f"Houses in a circle hold amounts {fmt_list(xs)} (the first and last are neighbours). What is the "
                f"maximum total you can take without taking two neighbouring houses?", max(line(xs[1:]), line(xs[:-1])))


@register("gym/egg_drop")
class EggDrop(IntAnswer):
    family, description = F, "Minimum worst-case drops to find the critical floor with k eggs."

    def build(self, rng, d):
        k, n = rng.randint(1, 2 + d // 3), rng.randint(5, grow(20, d, 1.5))
        if k == 1:
            ans = n
        else:  # f(t, k) = floors decidable with t drops and k eggs
            t, f = 0, [0] * (k + 1)
            while f[k] < n:
                t += 1
                f = [0] + [f[e] + f[e - 1] + 1 for e in range(1, k + 1)]
            ans = t
        return (f"With {k} identical eggs and a building of {n} floors, what is the minimum number of drops that "
                f"always suffices to determine the highest floor from which an egg does not break?", ans)


@register("gym/weighted_interval_scheduling")
class WeightedIntervalScheduling(IntAnswer):
    family, description = F, "Maximum weight set of non-overlapping jobs."

    def build(self, rng, d):
        jobs = []
        for _ in range(_n(d, 5, 6)):
            s = rng.randint(0, 20 + 4 * d)
            jobs.append((s, s + rng.randint(1, 8 + d), rng.randint(1, 20 + d)))
        jobs.sort(key=lambda j: j[1])
        best = [0] * (len(jobs) + 1)
        ends = [e for _, e, _ in jobs]
        for i, (s, e, w) in enumerate(jobs, 1):
            k = bisect_right(ends, s, 0, i - 1)  # jobs[:k] (among the first i - 1) end by s: ends are sorted
            best[i] = max(best[i - 1], best[k] + w)
        shown = ", ".join(f"[{s}, {e}) weight {w}" for s, e, w in jobs)
        return (f"Jobs occupy half-open time intervals: {shown}. Choose non-overlapping jobs to maximise the total "
                f"weight. What is the maximum total weight?", best[-1])


@register("gym/tree_max_independent_set")
class TreeMaxIndependentSet(IntAnswer):
    family, description = F, "Maximum-weight independent set in a tree."

    def build(self, rng, d):
        n = _n(d, 5)
        edges = random_tree(rng, n)
        w = [rng.randint(1, 20 + d) for _ in range(n)]
        adj = [[] for _ in range(n)]
        for u, v in edges:
            adj[u].append(v)
            adj[v].append(u)
        order, par = [0], [-1] * n
        for u in order:
            for v in adj[u]:
                if v != par[u]:
                    par[v] = u
                    order.append(v)
        inc, exc = w[:], [0] * n
        for u in reversed(order):
            if par[u] >= 0:
                inc[par[u]] += exc[u]
                exc[par[u]] += max(inc[u], exc[u])
        return (f"A tree has vertices 0..{n - 1} with weights {fmt_list(w)} and edges "
                f"{', '.join(f'{u}-{v}' for u, v in edges)}. What is the maximum total weight of a set of vertices "
                f"no two of which are adjacent?", max(inc[0], exc[0]))


@register("gym/triangle_min_path")
class TriangleMinPath(IntAnswer):
    family, description = F, "Minimum top-to-bottom path sum in a number triangle."

    def build(self, rng, d):
        rows = [[rng.randint(-5, 20 + d) for _ in range(i + 1)] for i in range(grow_until(3, d, 30, 0.4, 1.1, 0.7))]
        best = rows[-1][:]
        for row in reversed(rows[:-1]):
            best = [x + min(best[i], best[i + 1]) for i, x in enumerate(row)]
        shown = "\n".join(fmt_list(r) for r in rows)
        return (f"In this number triangle, a path starts at the top and moves to one of the two adjacent numbers in the "
                f"row below. What is the minimum path sum from top to bottom?\n{shown}", best[0])


@register("gym/word_break_count")
class WordBreakCount(IntAnswer):
    family, description = F, "Number of ways to segment a string into dictionary words."

    def build(self, rng, d):
        # a string with one split only was 70-76% of the problems at difficulties 0-1: mostly drawn again
        return balanced(rng, lambda: self._draw(rng, d), lambda ans: ans == 1)

    def _draw(self, rng, d):
        words = sorted({_word(rng, rng.randint(1, 3), "ab") for _ in range(3 + d // 2)})
        s = "".join(rng.choice(words) for _ in range(_n(d, 3)))
        ways = [1] + [0] * len(s)
        for i in range(1, len(s) + 1):
            ways[i] = sum(ways[i - len(w)] for w in words if s.endswith(w, 0, i))
        return (f"Dictionary: {', '.join(words)}. In how many ways can '{s}' be split into a sequence of dictionary "
                f"words (words may repeat)? Give the answer modulo 1000000007.", ways[-1] % MOD)


TSP_MAX_CITIES = 19


def tsp_tour(w):
    """Length of the shortest Hamiltonian cycle (Held-Karp, vectorised). ``dp[mask, v]``: the shortest path from city
    0 through the cities of ``mask`` (cities 1..n-1, bit ``v - 1`` for city ``v``) ending at ``v``, filled one subset
    size at a time (every subset one smaller is complete by then); 19 cities take ~0.3 s and 40 MB."""
    import numpy as np

    n = len(w)
    if n == 1:
        return 0
    m = n - 1
    dist = np.array(w, dtype=np.int64)
    step = dist[1:, 1:]  # step[u - 1, v - 1] = w[u][v]
    dp = np.full((1 << m, m), 1 << 60, dtype=np.int64)
    masks = np.arange(1 << m)
    size = np.zeros(1 << m, dtype=np.int64)
    for v in range(m):
        dp[1 << v, v] = dist[0, v + 1]
        size += masks >> v & 1
    for k in range(2, m + 1):
        layer = masks[size == k]
        for v in range(m):
            sel = layer[(layer >> v & 1) == 1]
            dp[sel, v] = (dp[sel ^ (1 << v)] + step[:, v]).min(axis=1)
    return int((dp[-1] + dist[1:, 0]).min())


@register("gym/tsp_bitmask")
class TSPBitmask(IntAnswer):
    family, description = F, "Shortest Hamiltonian cycle (travelling salesman, bitmask DP)."

    def build(self, rng, d):
        # a city per 3 levels up to difficulty 30 (14 cities), then one per 14 levels up to 19 (difficulty 100): the
        # O(2^n n^2) table took 9 s at 20 cities (difficulty 50) in pure Python; past 19 cities only the distances grow
        n = 4 + d // 3 if d <= 30 else min(TSP_MAX_CITIES, 14 + (d - 30) // 14)
        w = [[0] * n for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                w[i][j] = w[j][i] = rng.randint(1, 20 + 2 * d)
        best = tsp_tour(w)
        rows = "\n".join(fmt_list(r) for r in w)
        return (f"The symmetric distance matrix of {n} cities is below. What is the length of the shortest tour that "
                f"visits every city exactly once and returns to the start?\n{rows}", best)


@register("gym/boolean_parenthesization")
class BooleanParenthesization(IntAnswer):
    family, description = F, "Ways to parenthesise a boolean expression so it evaluates to true."
    max_difficulty = 45  # its recursion nests as deep as the expression is long: 13.7 s at 52, RecursionError at 54

    def build(self, rng, d):
        n = grow_until(3, d, 30, 1)  # 82 values at difficulty 30, then 1 per level: an O(n^3) table, recursion n deep
        vals = [rng.choice("TF") for _ in range(n)]
        ops = [rng.choice("&|^") for _ in range(n - 1)]

        @lru_cache(maxsize=None)
        def cnt(i, j):  # (ways true, ways false)
            if i == j:
                return (1, 0) if vals[i] == "T" else (0, 1)
            t = f = 0
            for k in range(i, j):
                (lt, lf), (rt, rf) = cnt(i, k), cnt(k + 1, j)
                tot = (lt + lf) * (rt + rf)
                op = ops[k]
                tt = lt * rt if op == "&" else tot - lf * rf if op == "|" else lt * rf + lf * rt
                t, f = t + tt, f + tot - tt
            return t, f

        expr = " ".join(v + (" " + ops[i] if i < n - 1 else "") for i, v in enumerate(vals))
        return (f"In how many ways can the boolean expression {expr} be fully parenthesised so that it evaluates to T? "
                f"(T = true, F = false, & = and, | = or, ^ = xor.) Give the answer modulo 1000000007.", cnt(0, n - 1)[0] % MOD)
