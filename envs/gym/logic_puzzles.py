"""Logic and constraint puzzles. Puzzles with many solutions are graded by checking the rules."""
from __future__ import annotations

import itertools
import math
import re
from collections import Counter, deque
from fractions import Fraction

from envs.base import register
from envs.gym._util import (
    _ARROWS, INVALID, GymEnv, IntAnswer, ParseError, StrAnswer, balanced, fmt_grid, fmt_list, grow_until, parse_grid,
    parse_groups, parse_int_list, parse_tokens,
)

F = "logic_puzzles"


class _GridPuzzle(GymEnv):
    """Answer is a full grid; ``givens`` (0 = blank) must be respected; ``valid(grid)`` checks the rules."""

    def format_answer(self, answer):
        return fmt_grid(answer)

    def parse(self, text, problem):
        g = parse_grid(text, len(problem.answer[0]))
        if len(g) > 1000:
            raise ParseError("grid too large")
        return g

    def valid(self, problem, grid) -> bool:
        raise NotImplementedError

    def grade(self, problem, value):
        ref = problem.answer
        if [len(r) for r in value] != [len(r) for r in ref]:
            return INVALID
        givens = problem.meta["givens"]
        if any(g and g != v for gr, vr in zip(givens, value) for g, v in zip(gr, vr)):
            return 0.0
        return 1.0 if self.valid(problem, value) else 0.0

    def wrong_answers(self, problem):
        ref = problem.answer
        bad = [r[:] for r in ref]
        i, j = next((i, j) for i, r in enumerate(problem.meta["givens"]) for j, g in enumerate(r) if not g)
        bad[i][j] = bad[i][(j + 1) % len(bad[i])]
        swap = [r[:] for r in ref]  # exchange a blank cell with another cell of its row
        k = next(k for k in range(len(swap[i])) if swap[i][k] != swap[i][j])
        swap[i][j], swap[i][k] = swap[i][k], swap[i][j]
        return [fmt_grid(bad), fmt_grid(ref[:-1]), fmt_grid(swap)]


def _blank(rng, sol, k):
    cells = [(i, j) for i in range(len(sol)) for j in range(len(sol[0]))]
    holes = set(rng.sample(cells, max(1, min(k, len(cells) - 1))))
    return [[0 if (i, j) in holes else sol[i][j] for j in range(len(sol[0]))] for i in range(len(sol))]


def _show(givens, blank="."):
    wide = max(max(r) for r in givens) > 9
    return "\n".join(" ".join(str(x) if x else blank for x in r) if wide else "".join(str(x) if x else blank for x in r)
                     for r in givens)


@register("gym/sudoku")
class Sudoku(_GridPuzzle):
    family, description = F, "Sudoku: 4x4, then 9x9, then 16x16... with more blanks as difficulty grows."
    max_difficulty = 143  # 169x169 (96k characters); the 196x196 grid of difficulty 144 passes the answer length limit

    def build(self, rng, d):
        d = min(d, 143)
        # box size 2 at difficulties 0-1, 3 at 2-23, then one more every 12 levels (13 at the top, 132-143); within
        # each box size the blanks ramp from 30% to 75% of the cells (the old min(0.75, 0.3 + 0.04 d) reached 75% at
        # 12 and stayed there, so 12-23 and each later box size were one flat level). 16x16 at 30% still has more
        # blanks than 9x9 at 75%
        b = 2 if d < 2 else 3 + max(0, (d - 12) // 12)
        start, span = (2, 22) if b == 3 else (24 + 12 * (b - 4), 12)
        n = b * b
        rows = [g * b + r for g in rng.sample(range(b), b) for r in rng.sample(range(b), b)]
        cols = [g * b + c for g in rng.sample(range(b), b) for c in rng.sample(range(b), b)]
        sym = rng.sample(range(1, n + 1), n)
        sol = [[sym[(b * (r % b) + r // b + c) % n] for c in cols] for r in rows]
        k = 5 + 3 * d if b == 2 else int(n * n * (0.3 + 0.45 * (d - start) / span))
        givens = _blank(rng, sol, k)
        return (f"Solve this {n}x{n} Sudoku (each row, column and {b}x{b} box contains 1..{n} once; '.' is "
                f"empty):\n{_show(givens)}\nAnswer the full grid, rows separated by ';' and numbers by spaces.",
                sol, {"givens": givens, "box": b})

    def valid(self, problem, g):
        b = problem.meta["box"]
        n, full = b * b, set(range(1, b * b + 1))
        boxes = [[g[r][c] for r in range(R, R + b) for c in range(C, C + b)] for R in range(0, n, b) for C in range(0, n, b)]
        return all(set(x) == full for x in [*g, *zip(*g), *boxes])


def queens_solution(n):
    """A solution of the n-queens problem for n >= 4 (explicit construction): column of each row. No longer what
    gym/n_queens asks for (memorised, it and its symmetric variants solved every problem): the tests check that."""
    evens, odds = list(range(2, n + 1, 2)), list(range(1, n + 1, 2))
    if n % 6 == 2:
        odds = [3, 1] + odds[2:]
        odds.remove(5)
        odds.append(5)
    elif n % 6 == 3:
        evens = evens[1:] + [2]
        odds = odds[2:] + [1, 3]
    return evens + odds


def random_queens(rng, n):
    """A random solution of the n-queens problem for n >= 4 (column of each row, 1-based), by min-conflicts: rows
    placed one by one on a random least-attacked column, then a random attacked queen moved to a random least-attacked
    column of its row until none is attacked (a fresh start after 4n + 40 moves). O(n^2): 3 ms at n = 100, 0.2 s at 1000."""
    while True:
        col = [0] * n
        cnt_c, cnt_u, cnt_d = [0] * n, [0] * (2 * n), [0] * (2 * n)  # queens per column, per r + c, per r - c + n

        def attacks(r, c):
            return cnt_c[c] + cnt_u[r + c] + cnt_d[r - c + n]

        def move(r, c, k):
            cnt_c[c] += k
            cnt_u[r + c] += k
            cnt_d[r - c + n] += k

        def place(r):
            a = [attacks(r, c) for c in range(n)]
            low = min(a)
            col[r] = rng.choice([c for c in range(n) if a[c] == low])
            move(r, col[r], 1)

        for r in rng.sample(range(n), n):
            place(r)
        for _ in range(4 * n + 40):
            hit = [r for r in range(n) if attacks(r, col[r]) > 3]  # a queen counts itself once in each of its lines
            if not hit:
                return [c + 1 for c in col]
            r = rng.choice(hit)
            move(r, col[r], -1)
            place(r)


def queens_ok(cols):
    n = len(cols)
    return sorted(cols) == list(range(1, n + 1)) and len({c - r for r, c in enumerate(cols)}) == n \
        and len({c + r for r, c in enumerate(cols)}) == n


@register("gym/n_queens")
class NQueens(GymEnv):
    family, description = F, "Place n non-attacking queens consistent with some pre-placed ones."

    def build(self, rng, d):
        n = 4 + d
        # a random solution, and at least one of its queens pre-placed: the explicit construction (4 symmetric
        # variants) solved every problem once memorised, and with no pre-placed queen any fixed solution did
        sol = random_queens(rng, n)
        fixed = sorted(rng.sample(range(n), min(n - 2, max(1, d // 2))))
        pre = ", ".join(f"row {r + 1} column {sol[r]}" for r in fixed) or "none"
        return (f"Place {n} queens on an {n}x{n} board so that no two attack each other. Pre-placed queens: {pre}. "
                f"Answer the column (1..{n}) of the queen in each row 1..{n}, separated by spaces.", sol,
                {"fixed": {str(r): sol[r] for r in fixed}})

    def format_answer(self, answer):
        return fmt_list(answer)

    def parse(self, text, problem):
        return parse_int_list(text)

    def grade(self, problem, value):
        if len(value) != len(problem.answer):
            return INVALID
        if any(value[int(r)] != c for r, c in problem.meta["fixed"].items()):
            return 0.0
        return 1.0 if queens_ok(value) else 0.0

    def wrong_answers(self, problem):
        a = problem.answer
        return [fmt_list(a[:1] * 2 + a[2:]), fmt_list(list(range(1, len(a) + 1))), fmt_list(a[:-1])]


@register("gym/sat_assignment")
class SatAssignment(GymEnv):
    family, description = F, "A satisfying assignment of a planted random 3-SAT formula."

    def build(self, rng, d):
        n = 3 + d
        truth = [rng.randrange(2) for _ in range(n)]
        clauses = []
        while len(clauses) < int(4 * n):
            vs = rng.sample(range(n), 3)
            lits = [v + 1 if rng.randrange(2) else -(v + 1) for v in vs]
            agree = sum((l > 0) == bool(truth[abs(l) - 1]) for l in lits)
            # q-hidden planting: a clause with 2 or 3 true literals is kept half the time, so that a literal agrees
            # with the hidden assignment as often as not (kept whenever satisfied, 57% do: the majority sign of
            # each variable then gave the assignment away)
            if agree == 1 or (agree > 1 and rng.randrange(2)):
                clauses.append(lits)
        shown = " AND ".join("(" + " OR ".join(f"x{l}" if l > 0 else f"NOT x{-l}" for l in c) + ")" for c in clauses)
        return (f"Find a truth assignment satisfying {shown}. Answer the values of x1..x{n} as 0/1 separated by spaces.",
                truth, {"clauses": clauses})

    def format_answer(self, answer):
        return fmt_list(answer)

    def parse(self, text, problem):
        t = re.sub(r"(?i)\btrue\b", "1", re.sub(r"(?i)\bfalse\b", "0", text)).strip()
        named = re.findall(r"x(\d+)\s*=\s*([01])", t)
        if named:  # x1=1, x2=0, ...
            if re.sub(r"x(\d+)\s*=\s*([01])", "", t).strip(" ,;"):
                raise ParseError("expected x<i>=0/1 pairs")
            vals: dict[int, int] = {}
            for i, v in named:
                if int(i) in vals and vals[int(i)] != int(v):
                    raise ParseError(f"x{i} is given two values")
                vals[int(i)] = int(v)
            if max(vals) > len(problem.answer) or min(vals) < 1:  # (before a list of that size is built)
                raise ParseError(f"the variables are x1..x{len(problem.answer)}")
            return [vals.get(i, -1) for i in range(1, max(vals) + 1)]
        if len(t) > 1 and re.fullmatch(r"[01]+", t):
            return [int(c) for c in t]
        return parse_int_list(t)

    def grade(self, problem, value):
        if len(value) != len(problem.answer) or any(x not in (0, 1) for x in value):
            return INVALID
        # all or nothing: a random assignment satisfies 7/8 of the clauses, and partial credit paid it
        return 1.0 if all(any((l > 0) == bool(value[abs(l) - 1]) for l in c) for c in problem.meta["clauses"]) else 0.0

    def wrong_answers(self, problem):
        a = problem.answer
        c = problem.meta["clauses"][0]
        bad = a[:]
        for l in c:
            bad[abs(l) - 1] = 0 if l > 0 else 1
        return [fmt_list(bad), fmt_list(a[:-1]), fmt_list([2] + a[1:])]


def _runs(line):
    return [len(g) for g in re.findall(r"1+", "".join(map(str, line)))] or [0]


@register("gym/nonogram")
class Nonogram(_GridPuzzle):
    family, description = F, "Nonogram: fill a grid matching row and column run clues (any solution)."

    def build(self, rng, d):
        # exponential up to difficulty 50 (80 x 80), then 0.4 rows and columns per level (100 x 100 at 100): the
        # clues ran to 1.1M characters at difficulty 100
        r = c = grow_until(3, d, 50, 0.4, 1.06, 0.5)
        sol = [[int(rng.random() < 0.55) for _ in range(c)] for _ in range(r)]
        rows, cols = [_runs(x) for x in sol], [_runs(x) for x in zip(*sol)]
        return (f"Solve the {r}x{c} nonogram. Row clues (top to bottom): "
                f"{'; '.join(fmt_list(x) for x in rows)}. Column clues (left to right): "
                f"{'; '.join(fmt_list(x) for x in cols)}. Each clue lists the lengths of the runs of filled cells "
                f"in order (0 = empty line). Answer the grid as rows of 0/1 (1 = filled) separated by ';'.",
                sol, {"givens": [[0] * c for _ in range(r)], "rows": rows, "cols": cols})

    def valid(self, problem, g):
        if any(x not in (0, 1) for r in g for x in r):
            return False
        return [_runs(x) for x in g] == problem.meta["rows"] and [_runs(x) for x in zip(*g)] == problem.meta["cols"]

    def wrong_answers(self, problem):
        ref = problem.answer
        bad = [r[:] for r in ref]
        bad[0][0] ^= 1
        return [fmt_grid(bad), fmt_grid(ref[:-1]), fmt_grid([[2] * len(ref[0])] * len(ref))]


@register("gym/cryptarithm")
class Cryptarithm(GymEnv):
    family, description = F, "Letter-digit addition puzzle (any valid assignment)."

    def build(self, rng, d):
        letters = rng.sample("ABCDEFGHIJKLMNOPQRSTUVWXYZ", 10)
        digit_letter = dict(zip(range(10), letters))
        k = 2 + (d + 1) // 2
        nums = [rng.randint(10 ** (k - 1), 10 ** k - 1) for _ in range(2 + d // 6)]
        s = sum(nums)
        enc = lambda x: "".join(digit_letter[int(ch)] for ch in str(x))  # noqa: E731
        words = [enc(x) for x in nums]
        used = sorted(set("".join(words) + enc(s)))
        inv = {v: k for k, v in digit_letter.items()}
        return (f"Solve the cryptarithm {' + '.join(words)} = {enc(s)}: each letter stands for a different digit and "
                f"no number starts with 0. Answer as letter=digit pairs separated by commas, e.g. A=1, B=2.",
                {ch: inv[ch] for ch in used}, {"words": words, "total": enc(s)})

    def format_answer(self, answer):
        return ", ".join(f"{k}={v}" for k, v in sorted(answer.items()))

    def parse(self, text, problem):
        pairs = re.findall(r"([A-Za-z])\s*=\s*(\d)", text)
        rest = re.sub(r"([A-Za-z])\s*=\s*(\d)", "", text)
        if not pairs or re.search(r"[A-Za-z0-9]", rest):
            raise ParseError("expected letter=digit pairs")
        out = {}
        for k, v in pairs:
            if k.upper() in out and out[k.upper()] != int(v):
                raise ParseError(f"letter {k} assigned twice")
            out[k.upper()] = int(v)
        return out

    def grade(self, problem, value):
        if set(value) != set(problem.answer) or len(set(value.values())) != len(value):
            return INVALID
        words, total = problem.meta["words"], problem.meta["total"]
        if any(value[w[0]] == 0 for w in words + [total]):
            return 0.0
        num = lambda w: int("".join(str(value[ch]) for ch in w))  # noqa: E731
        return 1.0 if sum(map(num, words)) == num(total) else 0.0

    def wrong_answers(self, problem):
        a = dict(problem.answer)
        ks = sorted(a)
        swapped = dict(a)
        for x, y in itertools.combinations(ks, 2):  # a digit swap that breaks the sum
            cand = dict(a)
            cand[x], cand[y] = a[y], a[x]
            if self.grade(problem, cand) < 1:
                swapped = cand
                break
        dup = dict(a)
        dup[ks[0]] = a[ks[1]]
        return [self.format_answer(swapped), self.format_answer(dup), self.format_answer({k: a[k] for k in ks[1:]})]


@register("gym/magic_square")
class MagicSquare(_GridPuzzle):
    family, description = F, "Complete a normal magic square of odd order."
    max_difficulty = 396  # 135x135 (98k characters); the 137x137 of difficulty 397 passes the answer length limit

    def build(self, rng, d):
        d = min(d, 396)
        # 3x3 (8 squares in all) only at level 0; from 5x5 on, squares from two orthogonal diagonal Latin squares
        # (n L1 + L2 + 1, cyclic: n not a multiple of 3) or the Siamese one, under the symmetries of the square and a
        # centrally symmetric permutation of rows and columns together (every line stays magic): the Siamese
        # squares alone were 8 per order, memorised in full
        n = 3 if d == 0 else 5 + 2 * ((d - 1) // 6)
        pairs = [(a, b) for a in range(1, n) for b in range(1, n)
                 if all(math.gcd(x % n, n) == 1 for x in (a, b, a + b, a - b))]
        if pairs and rng.random() < 0.8:
            while True:
                (a1, b1), (a2, b2) = rng.choice(pairs), rng.choice(pairs)
                if math.gcd((a1 * b2 - a2 * b1) % n, n) == 1:  # orthogonal
                    break
            c1, c2 = rng.randrange(n), rng.randrange(n)
            sq = [[n * ((a1 * i + b1 * j + c1) % n) + (a2 * i + b2 * j + c2) % n + 1 for j in range(n)]
                  for i in range(n)]
        else:
            sq = [[0] * n for _ in range(n)]
            i, j = 0, n // 2
            for v in range(1, n * n + 1):
                sq[i][j] = v
                ni, nj = (i - 1) % n, (j + 1) % n
                if sq[ni][nj]:
                    ni, nj = (i + 1) % n, j
                i, j = ni, nj
        for _ in range(rng.randrange(4)):
            sq = [list(r) for r in zip(*sq[::-1])]
        if rng.random() < 0.5:
            sq = [r[::-1] for r in sq]
        if rng.random() < 0.5:
            sq = [[n * n + 1 - x for x in r] for r in sq]
        half = list(range(n // 2))
        rng.shuffle(half)
        sigma = list(range(n))
        for k, h in enumerate(half):  # pair k goes to pair h, maybe mirrored: sigma(n-1-i) = n-1-sigma(i)
            lo, hi = (h, n - 1 - h) if rng.random() < 0.5 else (n - 1 - h, h)
            sigma[k], sigma[n - 1 - k] = lo, hi
        perm = [[0] * n for _ in range(n)]
        for i in range(n):
            for j in range(n):
                perm[sigma[i]][sigma[j]] = sq[i][j]
        sq = perm
        givens = _blank(rng, sq, min(n * n * 3 // 4, 2 + d + n))
        return (f"Complete the {n}x{n} magic square below using each of 1..{n * n} exactly once so that every row, "
                f"column and both diagonals sum to {n * (n * n + 1) // 2} ('.' is empty):\n{_show(givens)}\n"
                f"Answer the full grid, rows separated by ';' and numbers by spaces.", sq, {"givens": givens})

    def valid(self, problem, g):
        n = len(g)
        s = n * (n * n + 1) // 2
        lines = [*g, *zip(*g), [g[i][i] for i in range(n)], [g[i][n - 1 - i] for i in range(n)]]
        return sorted(x for r in g for x in r) == list(range(1, n * n + 1)) and all(sum(x) == s for x in lines)


@register("gym/latin_square")
class LatinSquare(_GridPuzzle):
    family, description = F, "Complete a partial Latin square (any valid completion)."
    max_difficulty = 339  # 172x172 (99.9k characters); the 173x173 of difficulty 340 passes the answer length limit

    def build(self, rng, d):
        d = min(d, 339)
        n = 3 + d // 2
        rows, cols, sym = rng.sample(range(n), n), rng.sample(range(n), n), rng.sample(range(1, n + 1), n)
        sol = [[sym[(r + c) % n] for c in cols] for r in rows]
        givens = _blank(rng, sol, int(n * n * min(0.7, 0.3 + 0.05 * d)))
        return (f"Complete this {n}x{n} Latin square (each row and column contains 1..{n} exactly once; '.' is "
                f"empty):\n{_show(givens)}\nAnswer the full grid, rows separated by ';' and numbers by spaces.",
                sol, {"givens": givens})

    def valid(self, problem, g):
        full = list(range(1, len(g) + 1))
        return all(sorted(x) == full for x in [*g, *zip(*g)])


_KK = {  # kind: (text, evaluator, negation)
    "knight": ("{a} is a knight", lambda t, a, b: t[a], "knave"),
    "knave": ("{a} is a knave", lambda t, a, b: not t[a], "knight"),
    "both": ("{a} and {b} are both knights", lambda t, a, b: t[a] and t[b], "someknave"),
    "someknave": ("at least one of {a} and {b} is a knave", lambda t, a, b: not (t[a] and t[b]), "both"),
    "same": ("{a} and {b} are of the same kind", lambda t, a, b: t[a] == t[b], "diff"),
    "diff": ("{a} and {b} are of different kinds", lambda t, a, b: t[a] != t[b], "same"),
    "someknight": ("at least one of {a} and {b} is a knight", lambda t, a, b: t[a] or t[b], "bothknaves"),
    "bothknaves": ("{a} and {b} are both knaves", lambda t, a, b: not (t[a] or t[b]), "someknight"),
}
_NAMES = ["Ann", "Bob", "Cid", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jon", "Kim", "Lou", "Max", "Ned", "Oli",
          "Pam", "Quin", "Rex", "Sue", "Tom", "Uma", "Vic", "Wes", "Xia", "Yan", "Zed"]


KK_MAX_PEOPLE = 20


@register("gym/knights_knaves")
class KnightsKnaves(GymEnv):
    family, description = F, "Knights always tell the truth, knaves always lie: who is who? (unique solution)"

    def build(self, rng, d):
        # one inhabitant per 3 levels up to difficulty 30 (12), then one per 8 levels up to 20 (difficulty 94): the
        # statements filter the 2^n assignments once each (~0.2 s at 20; all of them re-enumerated per statement took
        # 4 s at 18 people, difficulty 50)
        n = 2 + d // 3 if d <= 30 else min(KK_MAX_PEOPLE, 12 + (d - 30) // 8)
        names = [_NAMES[i % 26] + ("" if i < 26 else str(i // 26)) for i in range(n)]
        truth = [bool(rng.randrange(2)) for _ in range(n)]
        stmts = []
        sols = range(1 << n)  # the assignments (bit i: inhabitant i is a knight) consistent with the statements so far
        while True:
            sp = rng.randrange(n)
            kind = rng.choice(list(_KK))
            others = [i for i in range(n) if i != sp] if n > 2 else list(range(n))
            a, b = rng.sample(others, 2)
            if _KK[kind][1](truth, a, b) != truth[sp]:
                kind = _KK[kind][2]
            stmts.append((sp, kind, a, b))
            says = [int(_KK[kind][1]((ta, tb), 0, 1)) for ta in (False, True) for tb in (False, True)]
            sols = [t for t in sols if says[(t >> a & 1) * 2 + (t >> b & 1)] == t >> sp & 1]
            if len(sols) == 1:
                break
        text = " ".join(f"{names[s]} says: \"{_KK[k][0].format(a=names[x], b=names[y])}.\"" for s, k, x, y in stmts)
        return (f"On an island, knights always tell the truth and knaves always lie. The inhabitants are "
                f"{', '.join(names)}. {text} Who is a knight and who is a knave? Answer K or N for each inhabitant in "
                f"the order listed, separated by spaces.", ["K" if t else "N" for t in truth])

    def format_answer(self, answer):
        return fmt_list(answer)

    def parse(self, text, problem):
        # "Ann: K", "Bob is a knave"
        labelled = re.findall(r"\b([A-Z][a-z]+\d*)\s*(?:[:=]|is(?: a)?)\s*([A-Za-z]+)", text)
        if labelled:  # by name, in any order: every inhabitant once
            names = re.search(r"inhabitants are (.*?)\. ", problem.prompt)[1].split(", ")
            got = {}
            for name, word in labelled:
                if name not in names or name in got:
                    raise ParseError(f"{name!r} is not an inhabitant, or named twice")
                got[name] = word
            rest = re.sub(r"\b[A-Z][a-z]+\d*\s*(?:[:=]|is(?: a)?)\s*[A-Za-z]+", "", text).strip(" ,;.\n")
            if rest or len(got) != len(names):
                raise ParseError("name every inhabitant once, with K or N")
            text = " ".join(got[n] for n in names)
        out = []
        for tok in parse_tokens(text):
            t = tok.lower()
            if t in ("k", "knight"):
                out.append("K")
            elif t in ("n", "knave"):
                out.append("N")
            else:
                raise ParseError(f"unexpected token {tok[:20]!r}")
        return out

    def grade(self, problem, value):
        if len(value) != len(problem.answer):
            return INVALID
        return 1.0 if value == problem.answer else 0.0

    def wrong_answers(self, problem):
        a = problem.answer
        flip = ["N" if x == "K" else "K" for x in a]
        return [fmt_list(flip), fmt_list(a[:-1] + flip[-1:]), fmt_list(a + ["K"])]


def _hanoi(n, a, b, c, out):
    if n:
        _hanoi(n - 1, a, c, b, out)
        out.append([a, c])
        _hanoi(n - 1, b, a, c, out)


def _hanoi_from(k, pos, t, out):
    """The optimal moves that bring disks 1..k (disk i on peg ``pos[i - 1]``) onto peg ``t``: the largest out of
    place goes straight to ``t`` once the smaller ones are gathered on the third peg (unique and optimal)."""
    if not k:
        return
    if pos[k - 1] == t:
        _hanoi_from(k - 1, pos, t, out)
        return
    other = 6 - pos[k - 1] - t
    _hanoi_from(k - 1, pos, other, out)
    out.append([pos[k - 1], t])
    _hanoi(k - 1, other, pos[k - 1], t, out)
    for i in range(k):
        pos[i] = t


@register("gym/tower_of_hanoi")
class TowerOfHanoi(GymEnv):
    family, description = F, "Optimal move sequence for the Tower of Hanoi."
    max_difficulty = 35  # 13 disks: 8191 moves; beyond, the optimal answer passes the answer length limits

    def build(self, rng, d):
        n = 2 + min(d, 35) // 3  # at most 13 disks: 2^(2 + d // 3) moves took minutes and gigabytes at 100
        dst = rng.randint(1, 3)
        if rng.random() < 0.3:  # the classic start: every disk on one other peg
            start = [rng.choice([p for p in (1, 2, 3) if p != dst])] * n
        else:  # any position (disk i on start[i - 1]): a level had 6 problems (peg pairs), 3 levels the same
            start = [rng.randint(1, 3) for _ in range(n)]
            if all(p == dst for p in start):
                start[-1] = rng.choice([p for p in (1, 2, 3) if p != dst])
        moves: list = []
        _hanoi_from(n, list(start), dst, moves)
        pegs = {p: [i for i in range(n, 0, -1) if start[i - 1] == p] for p in (1, 2, 3)}
        shown = "; ".join(f"peg {p}: {' '.join(map(str, pegs[p])) or 'empty'}" for p in (1, 2, 3))
        return (f"Tower of Hanoi with {n} disks, numbered 1 (smallest) to {n} (largest), on pegs 1, 2, 3, each peg "
                f"listed from bottom to top: {shown}. Move them all to peg {dst}, one disk at a time, never a larger "
                f"disk on a smaller one, in the minimum number of moves. Answer the moves as 'from to' pairs "
                f"separated by commas.", moves, {"n": n, "start": start, "dst": dst})

    def format_answer(self, answer):
        return ", ".join(f"{a} {b}" for a, b in answer)

    def parse(self, text, problem):
        if len(text) > 60_000:
            raise ParseError("too many moves")
        return parse_groups(_ARROWS.sub(" ", text), 2)  # "3 -> 2, 3 -> 1" as "3 2, 3 1"

    def grade(self, problem, value):
        n, dst = problem.meta["n"], problem.meta["dst"]
        start = problem.meta.get("start") or [problem.meta["src"]] * n  # (problems made before starts varied)
        pegs = {p: [i for i in range(n, 0, -1) if start[i - 1] == p] for p in (1, 2, 3)}
        for a, b in value:
            if a not in pegs or b not in pegs or not pegs[a] or (pegs[b] and pegs[b][-1] < pegs[a][-1]):
                return INVALID
            pegs[b].append(pegs[a].pop())
        if len(pegs[dst]) != n:
            return 0.0
        return (len(problem.answer) / len(value)) ** 5

    def wrong_answers(self, problem):
        m = problem.answer
        return [self.format_answer(m[:-1]), self.format_answer(m[1:]), self.format_answer([m[0], m[0][::-1]] + m)]


_DIRS = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}


@register("gym/sliding_puzzle")
class SlidingPuzzle(GymEnv):
    family, description = F, "Solve a scrambled sliding-tile puzzle (any valid move sequence)."

    def build(self, rng, d):
        k = 3 + d // 8
        board = list(range(1, k * k)) + [0]
        pos, moves, last = k * k - 1, [], None
        inverse = {"U": "D", "D": "U", "L": "R", "R": "L"}
        while len(moves) < 3 + 2 * d:
            m = rng.choice([x for x in "UDLR" if x != inverse.get(last)])
            r, c = divmod(pos, k)
            nr, nc = r + _DIRS[m][0], c + _DIRS[m][1]
            if 0 <= nr < k and 0 <= nc < k:
                npos = nr * k + nc
                board[pos], board[npos] = board[npos], board[pos]
                pos, last = npos, m
                moves.append(m)
        sol = "".join(inverse[m] for m in reversed(moves))
        rows = "\n".join(" ".join(str(x) for x in board[i * k:(i + 1) * k]) for i in range(k))
        return (f"A {k}x{k} sliding puzzle (0 is the blank):\n{rows}\nThe goal has 1..{k * k - 1} in row-major order "
                f"with the blank last. Give a sequence of moves that solves it, as letters U/D/L/R (the direction the "
                f"blank moves), e.g. ULDR.", sol, {"board": board, "k": k})

    def parse(self, text, problem):
        t = re.sub(r"[\s,;]", "", text).upper().removesuffix(".")  # "DRR." ends a sentence, as "42." does
        if not re.fullmatch(r"[UDLR]*", t) or len(t) > 20_000:
            raise ParseError("expected a string of U/D/L/R")
        return t

    def grade(self, problem, value):
        k, board = problem.meta["k"], list(problem.meta["board"])
        pos = board.index(0)
        for m in value:
            r, c = divmod(pos, k)
            nr, nc = r + _DIRS[m][0], c + _DIRS[m][1]
            if not (0 <= nr < k and 0 <= nc < k):
                return INVALID
            board[pos], board[nr * k + nc] = board[nr * k + nc], 0
            pos = nr * k + nc
        return 1.0 if board == list(range(1, k * k)) + [0] else 0.0

    def wrong_answers(self, problem):
        s = problem.answer
        return [s[:-1], s + "U", s + "L", s + "X"]  # from the goal, U and L are legal but unsolve it


@register("gym/lights_out")
class LightsOut(GymEnv):
    family, description = F, "Lights Out: which buttons turn every light off (any valid set)."

    def build(self, rng, d):
        # exponential up to difficulty 50 (75 x 75), then half a row and a column per level (100 x 100 at 100): the
        # grid ran to 1.1M characters at difficulty 100
        r = c = grow_until(3, d, 50, 0.5, 1.06, 0.4)
        presses = sorted(rng.sample([(i, j) for i in range(r) for j in range(c)], rng.randint(1, 2 + d)))
        g = self._apply([[0] * c for _ in range(r)], presses)
        rows = "\n".join("".join(map(str, row)) for row in g)
        return (f"Lights Out on a {r}x{c} grid (1 = on). Pressing a cell toggles it and its up/down/left/right "
                f"neighbours. Which cells should be pressed to turn all lights off? Answer as 'row col' pairs "
                f"(0-indexed) separated by commas.\n{rows}", [list(p) for p in presses], {"grid": g})

    @staticmethod
    def _apply(g, presses):
        g = [row[:] for row in g]
        r, c = len(g), len(g[0])
        for i, j in presses:
            for a, b in ((i, j), (i + 1, j), (i - 1, j), (i, j + 1), (i, j - 1)):
                if 0 <= a < r and 0 <= b < c:
                    g[a][b] ^= 1
        return g

    def format_answer(self, answer):
        return ", ".join(f"{i} {j}" for i, j in answer)

    def parse(self, text, problem):
        if text.strip().lower() == "none":
            return []
        return parse_groups(text, 2)

    def grade(self, problem, value):
        g = problem.meta["grid"]
        if any(not (0 <= i < len(g) and 0 <= j < len(g[0])) for i, j in value):
            return INVALID
        out = self._apply(g, value)
        return 1.0 if not any(map(any, out)) else 0.0

    def wrong_answers(self, problem):
        a = problem.answer
        return [self.format_answer(a[:-1]) or "none", self.format_answer(a + [[0, 0] if a[0] != [0, 0] else [0, 1]]),
                self.format_answer(a + [[99, 99]])]


@register("gym/water_jugs")
class WaterJugs(IntAnswer):
    family, description = F, "Fewest operations to measure a volume with two jugs (BFS)."

    def build(self, rng, d):
        # a volume one fill away (a jug's own size) was 61-65% of the problems at difficulties 0-1: mostly drawn again
        return balanced(rng, lambda: self._draw(rng, d), lambda ans: ans == 1)

    def _draw(self, rng, d):
        a, b = rng.randint(2, 5 + 3 * d), rng.randint(2, 5 + 3 * d)
        dist = {(0, 0): 0}
        q = deque([(0, 0)])
        while q:
            x, y = q.popleft()
            p1, p2 = min(x, b - y), min(y, a - x)
            for s in ((a, y), (x, b), (0, y), (x, 0), (x - p1, y + p1), (x + p2, y - p2)):
                if s not in dist:
                    dist[s] = dist[(x, y)] + 1
                    q.append(s)
        best: dict[int, int] = {}
        for (x, y), k in dist.items():
            for v in (x, y):
                if v and (v not in best or k < best[v]):
                    best[v] = k
        t = rng.choice(sorted(best))
        return (f"You have an empty {a}-litre jug and an empty {b}-litre jug. Each operation fills a jug, empties a "
                f"jug, or pours one jug into the other until the source is empty or the target is full. What is the "
                f"minimum number of operations until one of the jugs holds exactly {t} litres?", best[t])


@register("gym/boolean_expression")
class BooleanExpression(StrAnswer):
    family, description, fold_case = F, "Evaluate a nested boolean expression.", True

    def build(self, rng, d):
        def expr(k):
            if k == 0:
                v = rng.random() < 0.5
                return ("True" if v else "False"), v
            if rng.random() < 0.2:
                s, v = expr(k - 1)
                return f"not {s}", not v
            i = rng.randrange(k)
            (ls, lv), (rs, rv) = expr(i), expr(k - 1 - i)
            op = rng.choice(["and", "or", "xor"])
            return f"({ls} {op} {rs})", (lv and rv) if op == "and" else (lv or rv) if op == "or" else lv != rv

        s, v = expr(grow_until(2, d, 30, 6))  # 1.1^d operators to difficulty 30 (64), then 6 per level
        return f"Evaluate the boolean expression {s}. Answer True or False.", "True" if v else "False"

    def wrong_answers(self, problem):
        return ["False" if problem.answer == "True" else "True", "Maybe"]


def _feedback(code, guess):
    black = sum(a == b for a, b in zip(code, guess))
    common = sum((Counter(code) & Counter(guess)).values())
    return black, common - black


@register("gym/mastermind")
class Mastermind(GymEnv):
    family, description = F, "Mastermind: a code consistent with all guess feedback (any consistent code)."

    def build(self, rng, d):
        L, k = 3 + d // 3, 4 + d // 3
        code = [rng.randint(1, k) for _ in range(L)]
        guesses = [[rng.randint(1, k) for _ in range(L)] for _ in range(3 + d)]
        lines = "\n".join(f"{fmt_list(g)} -> {b} exact, {w} misplaced" for g in guesses for b, w in [_feedback(code, g)])
        return (f"A secret code has {L} positions, each a colour 1..{k} (repeats allowed). For each guess, 'exact' "
                f"counts right colour in the right position and 'misplaced' counts further right colours in wrong "
                f"positions:\n{lines}\nGive a code consistent with all the feedback, colours separated by spaces.",
                code, {"guesses": guesses, "k": k})

    def format_answer(self, answer):
        return fmt_list(answer)

    def parse(self, text, problem):
        return parse_int_list(text)

    def grade(self, problem, value):
        if len(value) != len(problem.answer) or any(not 1 <= x <= problem.meta["k"] for x in value):
            return INVALID
        ok = all(_feedback(value, g) == _feedback(problem.answer, g) for g in problem.meta["guesses"])
        return 1.0 if ok else 0.0

    def wrong_answers(self, problem):
        a, gs = problem.answer, problem.meta["guesses"]
        out = [fmt_list(a[:-1]), fmt_list([problem.meta["k"] + 1] + a[1:])]
        for g in gs:  # a guess that is not itself consistent
            if _feedback(g, g) != _feedback(a, g):
                out.append(fmt_list(g))
                break
        return out


class _Expr:
    """A tiny exact arithmetic parser (+ - * / parentheses, integer literals): at most ``max_tokens`` tokens and
    parentheses nested at most ``MAX_DEPTH`` deep (each level is three frames of recursion)."""

    MAX_DEPTH = 200

    def __init__(self, text, max_tokens=400):
        self.toks = re.findall(r"\d+|[-+*/()]", text)
        if "".join(self.toks) != re.sub(r"\s", "", text) or len(self.toks) > max_tokens:
            raise ParseError("expression may only contain integers, + - * / and parentheses")
        self.i, self.depth, self.nums = 0, 0, []

    def parse(self):
        v = self.sum()
        if self.i != len(self.toks):
            raise ParseError("trailing tokens")
        return v

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else None

    def sum(self):
        v = self.prod()
        while self.peek() in ("+", "-"):
            op = self.toks[self.i]
            self.i += 1
            w = self.prod()
            v = None if v is None or w is None else v + w if op == "+" else v - w
        return v

    def prod(self):
        v = self.atom()
        while self.peek() in ("*", "/"):
            op = self.toks[self.i]
            self.i += 1
            w = self.atom()
            if v is None or w is None or (op == "/" and w == 0):
                v = None
            else:
                v = v * w if op == "*" else v / w
        return v

    def atom(self):
        t = self.peek()
        if t is None:
            raise ParseError("unexpected end")
        self.i += 1
        if t == "(":
            self.depth += 1
            if self.depth > self.MAX_DEPTH:
                raise ParseError("too deep")
            v = self.sum()
            if self.peek() != ")":
                raise ParseError("missing )")
            self.i += 1
            self.depth -= 1
            return v
        if t.isdigit():
            self.nums.append(int(t))
            return Fraction(int(t))
        raise ParseError(f"unexpected {t!r}")


@register("gym/countdown")
class Countdown(GymEnv):
    family, description = F, "Reach a target using each given number once with + - * / (any valid expression)."

    def build(self, rng, d):
        nums = [rng.randint(1, 10 + 2 * d) for _ in range(3 + d // 3)]
        items = [(str(x), Fraction(x)) for x in nums]
        while len(items) > 1:
            rng.shuffle(items)
            (a, x), (b, y) = items.pop(), items.pop()
            ops = ["+", "-", "*"] + (["/"] if y and (x / y).denominator == 1 else [])
            op = rng.choice(ops)
            v = x + y if op == "+" else x - y if op == "-" else x * y if op == "*" else x / y
            items.append((f"({a} {op} {b})", v))
        expr, target = items[0]
        return (f"Using each of the numbers {fmt_list(sorted(nums), ', ')} exactly once, with +, -, *, / and "
                f"parentheses, write an expression equal to {target}. Answer with the expression only.",
                expr[1:-1] if expr.startswith("(") else expr, {"nums": sorted(nums), "target": int(target)})

    def parse(self, text, problem):
        t = text.replace("\\times", "*").replace("\\cdot", "*").replace("\\div", "/").replace("×", "*")
        t = t.replace("÷", "/").replace("\u2212", "-").strip().removesuffix(".")
        t, *claims = t.split("=")  # "9 + 4 / 2 = 12" claims what is not so: each side after "=" must be the target
        if any(c.strip() != str(problem.meta["target"]) for c in claims):
            raise ParseError("what follows '=' must be the target")
        # the reference has 4 n - 5 tokens for n numbers (over 400 from difficulty ~297): room for twice as many
        e = _Expr(t, max(400, 8 * len(problem.meta["nums"])))
        return e.parse(), sorted(e.nums)

    def grade(self, problem, value):
        v, nums = value
        if nums != problem.meta["nums"] or v is None:
            return INVALID
        return 1.0 if v == problem.meta["target"] else 0.0

    def wrong_answers(self, problem):
        nums = problem.meta["nums"]
        return [f"({problem.answer}) + 1", " + ".join(map(str, nums[:-1])) or "0", f"({problem.answer}) * {nums[0]}"]
