"""Sorting and searching: orders, ranks, binary search, intervals, monotone stacks and windows."""
from __future__ import annotations

import bisect
from collections import Counter, deque

from envs.base import register
from envs.gym._util import GymEnv, IntAnswer, ListAnswer, balanced, fmt_list, grow_until, parse_groups

F = "sorting_searching"


def _arr(rng, d, lo=-50, hi=50, base=5, per_level=20):
    """``grow(base, d)`` values up to difficulty 30, then ``per_level`` more per level (1.1^d values made
    300k-character prompts at difficulty 100)."""
    n = grow_until(base, d, 30, per_level)
    s = 1 + d // 4
    return [rng.randint(lo * s, hi * s) for _ in range(n)]


@register("gym/sort_numbers")
class SortNumbers(ListAnswer):
    family, description = F, "Sort integers ascending (partial credit: fraction of correct positions^10)."

    def build(self, rng, d):
        xs = _arr(rng, d)
        return f"Sort these integers in ascending order, separated by spaces: {fmt_list(xs)}", sorted(xs)


@register("gym/kth_smallest")
class KthSmallest(IntAnswer):
    family, description = F, "The k-th smallest element of a list."

    def build(self, rng, d):
        xs = _arr(rng, d)
        k = rng.randint(1, len(xs))
        return f"What is the k-th smallest element (counting duplicates), for k = {k}, of: {fmt_list(xs)}?", sorted(xs)[k - 1]


def count_inversions(xs) -> int:
    if len(xs) < 2:
        return 0
    m = len(xs) // 2
    a, b = sorted(xs[:m]), sorted(xs[m:])
    inv = count_inversions(xs[:m]) + count_inversions(xs[m:])
    return inv + sum(len(a) - bisect.bisect_right(a, y) for y in b)


@register("gym/inversion_count")
class InversionCount(IntAnswer):
    family, description = F, "Number of inversions of a sequence."

    def build(self, rng, d):
        xs = _arr(rng, d, 0, 30)
        return f"How many pairs (i < j) with a[i] > a[j] are there in the sequence {fmt_list(xs)}?", count_inversions(xs)


@register("gym/lower_bound_queries")
class LowerBoundQueries(ListAnswer):
    family, description = F, "Binary search: first index with a[i] >= q for several queries."

    def build(self, rng, d):
        xs = sorted(_arr(rng, d, 0, 100))
        qs = [rng.randint(-5, 105 * (1 + d // 4)) for _ in range(3 + d // 2)]
        return (f"The sorted array a (0-indexed) is {fmt_list(xs)}. For each query q in {fmt_list(qs)}, give the "
                f"smallest index i with a[i] >= q ({len(xs)} if none). Answer the indices separated by spaces.",
                [bisect.bisect_left(xs, q) for q in qs])


@register("gym/merge_intervals")
class MergeIntervals(GymEnv):
    family, description = F, "Merge overlapping closed intervals."

    def build(self, rng, d):
        ivs = []
        for _ in range(grow_until(3, d, 30, 10)):
            a = rng.randint(0, 20 + 8 * d)
            ivs.append((a, a + rng.randint(0, 4 + d)))
        out = []
        for a, b in sorted(ivs):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        shown = ", ".join(f"[{a}, {b}]" for a, b in ivs)
        return (f"Merge the overlapping closed intervals {shown} (intervals that share a point merge). Give the "
                f"result sorted by start, as '[a, b], [c, d], ...'.", out)

    def format_answer(self, answer):
        return ", ".join(f"[{a}, {b}]" for a, b in answer)

    def parse(self, text, problem):
        return [list(t) for t in parse_groups(text, 2)]

    def grade(self, problem, value):
        return 1.0 if value == problem.answer else 0.0

    def wrong_answers(self, problem):
        a = problem.answer
        return [self.format_answer(a[:-1] + [[a[-1][0], a[-1][1] + 1]]), self.format_answer(a + [[999, 1000]]),
                self.format_answer(a[::-1]) if len(a) > 1 else "[0, 0], [1, 1], [2, 2]", "[1, 2"]


@register("gym/argsort")
class Argsort(ListAnswer):
    family, description = F, "Stable sorting permutation (indices of the sorted order)."

    def build(self, rng, d):
        xs = _arr(rng, d, 0, 20)
        return (f"For the array {fmt_list(xs)} (0-indexed), list the indices of its elements in the order of a "
                f"stable ascending sort (equal values keep their original order).",
                sorted(range(len(xs)), key=lambda i: xs[i]))


@register("gym/two_sum_count")
class TwoSumCount(IntAnswer):
    family, description = F, "Number of pairs i < j with a[i] + a[j] = T."

    def build(self, rng, d):
        if d < 2:
            # 5-6 numbers and a target made of two of them: one pair was the answer of 53-64% (2 of most of the rest):
            # a count drawn uniformly from 0..3 is the target, the array drawn again until it has it
            target = rng.randint(0, 3)
            return balanced(rng, lambda: self._draw(rng, d), lambda ans: ans != target, keep=0.0, tries=200)
        return self._draw(rng, d)

    def _draw(self, rng, d):
        xs = _arr(rng, d, 0, 20)
        t = rng.choice(xs) + rng.choice(xs)
        seen, cnt = Counter(), 0
        for x in xs:
            cnt += seen[t - x]
            seen[x] += 1
        return f"In the array {fmt_list(xs)}, how many index pairs i < j satisfy a[i] + a[j] = {t}?", cnt


@register("gym/top_k_frequent")
class TopKFrequent(ListAnswer):
    family, description, partial = F, "The k most frequent values (ties by smaller value).", False

    def build(self, rng, d):
        xs = _arr(rng, d, 1, 5 + d, 8)
        c = Counter(xs)
        k = rng.randint(1, min(3 + d // 3, len(c)))
        top = sorted(c, key=lambda v: (-c[v], v))[:k]
        return (f"List the {k} most frequent values in {fmt_list(xs)}, from most to least frequent; break ties by "
                f"the smaller value first.", top)


@register("gym/min_swaps_to_sort")
class MinSwapsToSort(IntAnswer):
    family, description = F, "Minimum number of swaps that sorts a permutation (cycle count)."

    def build(self, rng, d):
        n = grow_until(4, d, 30, 20)
        p = list(range(1, n + 1))
        rng.shuffle(p)
        seen, cycles = [False] * n, 0
        for i in range(n):
            if not seen[i]:
                cycles += 1
                j = i
                while not seen[j]:
                    seen[j] = True
                    j = p[j] - 1
        return (f"What is the minimum number of swaps (of any two elements) needed to sort the permutation "
                f"{fmt_list(p)} into ascending order?", n - cycles)


@register("gym/sliding_window_max")
class SlidingWindowMax(ListAnswer):
    family, description = F, "Maximum of every window of length k."

    def build(self, rng, d):
        xs = _arr(rng, d, 0, 60, per_level=20)
        k = rng.randint(2, max(2, len(xs) // 2))
        out, q = [], deque()  # indices of a decreasing run of values: the window's maximum first
        for i, x in enumerate(xs):
            while q and xs[q[-1]] <= x:
                q.pop()
            q.append(i)
            if q[0] <= i - k:
                q.popleft()
            if i >= k - 1:
                out.append(xs[q[0]])
        return (f"For the array {fmt_list(xs)}, give the maximum of each contiguous window of length {k}, from left "
                f"to right, separated by spaces.", out)


@register("gym/rotated_search")
class RotatedSearch(IntAnswer):
    family, description = F, "Find the index of a value in a rotated sorted array."

    def build(self, rng, d):
        xs = sorted(set(_arr(rng, d, 0, 200)))
        r = rng.randrange(len(xs))
        xs = xs[r:] + xs[:r]
        t = rng.choice(xs) if rng.random() < 0.8 else max(xs) + 1
        return (f"The array {fmt_list(xs)} is a rotation of a sorted array of distinct values. At which 0-based "
                f"index is {t}? Answer -1 if it is absent.", xs.index(t) if t in xs else -1)


@register("gym/next_greater")
class NextGreater(ListAnswer):
    family, description = F, "Next strictly greater element to the right (monotone stack)."

    def build(self, rng, d):
        xs = _arr(rng, d, 0, 40)
        out, st = [-1] * len(xs), []
        for i, x in enumerate(xs):
            while st and xs[st[-1]] < x:
                out[st.pop()] = x
            st.append(i)
        return (f"For each element of {fmt_list(xs)}, give the first element to its right that is strictly greater "
                f"(-1 if none), separated by spaces.", out)


@register("gym/range_count_queries")
class RangeCountQueries(ListAnswer):
    family, description = F, "Count elements within [l, r] for several queries."

    def build(self, rng, d):
        xs = _arr(rng, d, 0, 100)
        qs = []
        for _ in range(2 + d // 2):
            a, b = sorted(rng.randint(-5, 105 * (1 + d // 4)) for _ in range(2))
            qs.append((a, b))
        ans = [sum(a <= x <= b for x in xs) for a, b in qs]
        shown = ", ".join(f"[{a}, {b}]" for a, b in qs)
        return (f"For the array {fmt_list(xs)}, for each query range {shown}, count the elements x with "
                f"l <= x <= r. Answer the counts separated by spaces.", ans)


@register("gym/max_overlap")
class MaxOverlap(IntAnswer):
    family, description = F, "Maximum number of simultaneously active half-open intervals (sweep line)."

    def build(self, rng, d):
        if d < 5:
            # 2 rooms was the answer of 62-68% (4-5 short intervals), 3 rooms of 45-58% at difficulties 2-4: an answer
            # drawn uniformly from 1..3 (2..4 at difficulty 1, ...) is the target, the intervals drawn again until
            # they have it
            target = rng.randint(1 + min(d, 2), 3 + min(d, 2))
            return balanced(rng, lambda: self._draw(rng, d), lambda ans: ans != target, keep=0.0, tries=200)
        return self._draw(rng, d)

    def _draw(self, rng, d):
        ivs = []
        for _ in range(grow_until(4, d, 30, 10)):
            a = rng.randint(0, 30 + 5 * d)
            ivs.append((a, a + rng.randint(1, 10 + d)))
        ev = sorted([(a, 1) for a, _ in ivs] + [(b, -1) for _, b in ivs])
        cur = best = 0
        for _, e in ev:
            cur += e
            best = max(best, cur)
        shown = ", ".join(f"[{a}, {b})" for a, b in ivs)
        return (f"Meetings occupy the half-open time intervals {shown}. What is the minimum number of rooms needed "
                f"so that no two overlapping meetings share a room?", best)
