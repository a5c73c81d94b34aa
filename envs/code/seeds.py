"""Seed problems of the code environments: schema, loader and the built-in set.

A seed is a competitive-programming problem (one JSON object per line in a ``.jsonl`` file):

``id`` (str), ``title``, ``statement``, ``input_spec``, ``output_spec``, ``difficulty`` (1-3; a seed
of another difficulty is refused at load: the environments draw tiers 1-3 only),
``reference`` (Python program, stdin -> stdout), ``wrong`` (list of >= 1 incorrect programs),
``validator`` (optional Python program: exits 0 iff its stdin is a valid input),
``tests`` (list of ``{"input": str, "output": str}``; the first one or two are shown as examples),
``time_limit`` (optional, seconds per test; default 2), ``float_tol`` (optional).

The built-in seeds below were written for Cascade: the expected outputs of the hand-written tests
were worked out by hand, and the large tests (at the stated sizes) compute their answers here (closed
forms, or an algorithm other than the reference's), independently of the reference programs.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field

__all__ = ["Seed", "builtin_seeds", "load_seeds", "seeds_from_dicts", "MAX_SEED_DIFFICULTY"]

MAX_SEED_DIFFICULTY = 3  # the environments' tiers are 1..3 (``CodeEnv.max_difficulty``)


@dataclass
class Seed:
    id: str
    title: str
    statement: str
    input_spec: str
    output_spec: str
    reference: str
    wrong: list[str]
    tests: list[dict]
    difficulty: int = 1
    validator: str | None = None
    time_limit: float = 2.0
    float_tol: float | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict, where: str = "seed") -> "Seed":
        if not isinstance(d, dict):
            raise ValueError(f"{where}: a seed must be a JSON object")
        need = ["id", "statement", "reference", "wrong", "tests"]
        missing = [k for k in need if k not in d]
        if missing:
            raise ValueError(f"{where}: missing key(s) {missing}; a seed needs {need}")
        wrong = d["wrong"] if isinstance(d["wrong"], list) else [d["wrong"]]
        if not wrong or not all(isinstance(w, str) and w.strip() for w in wrong):
            raise ValueError(f"{where} ({d['id']}): 'wrong' must hold at least one program")
        tests = d["tests"]
        if not isinstance(tests, list) or not tests or not all(
                isinstance(t, dict) and "output" in t for t in tests):
            raise ValueError(f"{where} ({d['id']}): 'tests' must be a non-empty list of {{input, output}}")
        try:
            difficulty = int(d.get("difficulty", 1))
        except (TypeError, ValueError):
            raise ValueError(f"{where} ({d['id']}): 'difficulty' must be an integer 1-{MAX_SEED_DIFFICULTY}, "
                             f"not {d.get('difficulty')!r}") from None
        if difficulty < 1:
            raise ValueError(f"{where} ({d['id']}): difficulty {difficulty} is below 1, the lowest tier the code "
                             f"environments draw from (tiers 1-{MAX_SEED_DIFFICULTY})")
        if difficulty > MAX_SEED_DIFFICULTY:
            raise ValueError(f"{where} ({d['id']}): difficulty {difficulty} is above {MAX_SEED_DIFFICULTY}, the top "
                             f"tier the code environments draw from (tiers 1-{MAX_SEED_DIFFICULTY}); such a seed "
                             f"would never be drawn")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        return cls(
            id=str(d["id"]), title=str(d.get("title", d["id"])), statement=str(d["statement"]),
            input_spec=str(d.get("input_spec", "")), output_spec=str(d.get("output_spec", "")),
            reference=str(d["reference"]), wrong=[str(w) for w in wrong],
            tests=[{"input": str(t.get("input", "")), "output": str(t["output"])} for t in tests],
            difficulty=difficulty, validator=d.get("validator") or None,
            time_limit=float(d.get("time_limit", 2.0)),
            float_tol=None if d.get("float_tol") is None else float(d["float_tol"]),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d


def seeds_from_dicts(rows: list[dict], where: str = "seeds") -> list[Seed]:
    out = [Seed.from_dict(r, f"{where}[{i}]") for i, r in enumerate(rows)]
    ids = [s.id for s in out]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"{where}: duplicate seed id(s) {dup}")
    return out


def load_seeds(path: str) -> list[Seed]:
    """Seeds from a JSONL file of the schema above."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not JSON: {e}") from None
    if not rows:
        raise ValueError(f"{path}: no seeds")
    return seeds_from_dicts(rows, path)


# --------------------------------------------------------------------------------------------
# validators (programs: exit status 0 iff the input is valid)
# --------------------------------------------------------------------------------------------
def _v_list(nlo: int, nhi: int, lo: int, hi: int, head: int = 0, head_lo: int = 0, head_hi: int = 0) -> str:
    """A line ``n [h]``, then a line of ``n`` integers in [lo, hi]; ``head`` extra integers after n in [head_lo,
    head_hi]. By lines (the references read them so): the same values on other lines were valid, and the reference
    misread them (falsify paid for such "counterexamples", io_propose took them)."""
    return f"""import sys
lines = sys.stdin.read().split("\\n")
while lines and not lines[-1].strip():
    lines.pop()
assert len(lines) == 2
t = lines[0].split()
assert len(t) == 1 + {head}
n = int(t[0])
assert {nlo} <= n <= {nhi}
h = [int(x) for x in t[1:]]
assert all({head_lo} <= x <= {head_hi} for x in h)
a = [int(x) for x in lines[1].split()]
assert len(a) == n and all({lo} <= x <= {hi} for x in a)
"""


def _lines(count: int | None = None, first: int | None = None, rest: int | None = None) -> str:
    """The start of a validator that checks lines (the references read by lines): stdin read into ``s``, its
    non-blank lines into ``l``; ``count`` of them, the first of ``first`` tokens, each later one of ``rest``."""
    code = "import sys\ns = sys.stdin.read()\nl = [x for x in s.split('\\n') if x.strip()]\n"
    if count is not None:
        code += f"assert len(l) == {count}\n"
    if first is not None:
        code += f"assert len(l[0].split()) == {first}\n"
    if rest is not None:
        code += f"assert all(len(x.split()) == {rest} for x in l[1:])\n"
    return code


def _v_word(lo: int, hi: int, words: int = 1, alphabet: str = "abcdefghijklmnopqrstuvwxyz",
            per_line: bool = False) -> str:
    """``words`` words of ``lo``-``hi`` letters of ``alphabet``: on one line, or one per line (``per_line``)."""
    return f"""import sys
lines = [x for x in sys.stdin.read().split("\\n") if x.strip()]
assert len(lines) == ({words} if {per_line} else 1) and all(len(x.split()) == (1 if {per_line} else {words}) for x in lines)
t = " ".join(lines).split()
assert len(t) == {words}
assert all({lo} <= len(w) <= {hi} and set(w) <= set({alphabet!r}) for w in t)
"""


_V_GRAPH = """import sys
t = sys.stdin.read().split()
n, m = int(t[0]), int(t[1])
assert 1 <= n <= 100000 and 0 <= m <= 200000 and len(t) == 2 + {k} * m
for i in range(m):
    e = [int(x) for x in t[2 + {k} * i: 2 + {k} * i + {k}]]
    assert 1 <= e[0] <= n and 1 <= e[1] <= n
    assert all(1 <= w <= 10**9 for w in e[2:])
"""


def _t(*pairs: tuple[str, str]) -> list[dict]:
    return [{"input": i if i.endswith("\n") else i + "\n", "output": o} for i, o in pairs]


def _big_max() -> tuple[str, str]:
    a = [(i * 7919) % 1000003 - 500000 for i in range(100000)]
    return f"{len(a)}\n{' '.join(map(str, a))}\n", str(max(a))


def _big_pairs() -> tuple[str, str]:
    n = 100000
    return f"{n} 2\n{' '.join(['1'] * n)}\n", str(n * (n - 1) // 2)


def _big_chain() -> tuple[str, str]:
    n = 100000
    edges = "\n".join(f"{i} {i + 1}" for i in range(1, n))
    return f"{n} {n - 1}\n{edges}\n", "1"


def _big_list(answer) -> tuple[str, str]:
    """10^5 values of absolute value up to 10^9 (sums beyond 32 bits) and ``answer(values)``."""
    a = [(i * 7919 + 12345) % 2000000001 - 1000000000 for i in range(100000)]
    return f"{len(a)}\n{' '.join(map(str, a))}\n", str(answer(a))


def _kadane(a: list[int]) -> int:
    best = cur = a[0]
    for x in a[1:]:
        cur = max(x, cur + x)
        best = max(best, cur)
    return best


def _longest_run(a: list[int]) -> int:
    best = cur = 1
    for x, y in zip(a, a[1:]):
        cur = cur + 1 if y > x else 1
        best = max(best, cur)
    return best


_BILLIONS = "3\n1000000000 1000000000 1000000000"  # 32-bit sums overflow


def _big_lis() -> tuple[str, str]:
    n = 100000
    return f"{n}\n{' '.join(str(i // 2) for i in range(n))}\n", str(n // 2)


MOD = 1000000007


def _big_grid() -> tuple[str, str]:
    """A free 100 x 100 grid: C(198, 99) paths, far above the modulus."""
    r = c = 100
    return f"{r} {c}\n" + "".join("." * c + "\n" for _ in range(r)), str(math.comb(r + c - 2, r - 1) % MOD)


def _big_coins() -> tuple[str, str]:
    """Coins 1..50, amount 3000: the partitions of 3000 into parts of at most 50, counted by conjugation as
    the partitions into at most 50 parts (exactly k parts: e(n, k) = e(n - 1, k - 1) + e(n - k, k)); ~10^43."""
    k_max, amount = 50, 3000
    prev = [1] + [0] * amount  # e(n, 0)
    total = prev[amount]
    for k in range(1, k_max + 1):
        cur = [0] * (amount + 1)
        for n in range(k, amount + 1):
            cur[n] = prev[n - 1] + cur[n - k]
        total += cur[amount]
        prev = cur
    return f"{k_max} {amount}\n{' '.join(map(str, range(1, k_max + 1)))}\n", str(total % MOD)


def _big_brackets() -> list[tuple[str, str]]:
    """10^5 brackets nested to depth 5*10^4 (balanced) and the same with its last bracket wrong: a solution that
    deletes matched pairs over and over takes ~10^10 steps."""
    half = 25000
    ok = "([" * half + "])" * half
    return [(ok, "YES"), (ok[:-1] + "]", "NO")]


def _big_kth() -> tuple[str, str]:
    a = [(i * 7919 + 12345) % 2000000001 - 1000000000 for i in range(100000)]
    return f"{len(a)} 50000\n{' '.join(map(str, a))}\n", str(sorted(a)[49999])


def _big_path(weighted: bool) -> tuple[str, str]:
    """A path 1 - 2 - ... - 10^5 given from its far end (edges n-1..1): without weights 99,999 edges from 1 to n (a
    recursive search runs out of stack); with them (1000 per path edge) and a shortcut 1 - n of 10^9, the path
    (99,999,000). Relaxing edges in input order until nothing changes takes 10^5 passes: too slow."""
    n = 100000
    edges = [(i, i + 1) for i in range(n - 1, 0, -1)]
    if not weighted:
        return f"{n} {len(edges)}\n" + "".join(f"{u} {v}\n" for u, v in edges), str(n - 1)
    edges.append((1, n))
    w = [1000] * (n - 1) + [10 ** 9]
    return (f"{n} {len(edges)}\n" + "".join(f"{u} {v} {x}\n" for (u, v), x in zip(edges, w)),
            str(min(1000 * (n - 1), 10 ** 9)))


def _big_rotate() -> tuple[str, str]:
    """n = 10^5, k = 999,999,937 (k mod n = 99,937): rotating one step at a time takes k steps."""
    n, k = 100000, 999999937
    a = [(i * 31) % 1000003 for i in range(n)]
    return f"{n} {k}\n{' '.join(map(str, a))}\n", " ".join(str(a[(i - k) % n]) for i in range(n))


def _big_intervals() -> tuple[str, str]:
    """10^5 intervals [i, i+1] in a shuffled order (i * 7919 mod 10^5; 7919 is prime to 10^5): each touches the
    next, so they merge into one [0, 10^5]; a pairwise merge is quadratic."""
    n = 100000
    return f"{n}\n" + "".join(f"{j} {j + 1}\n" for j in ((i * 7919) % n for i in range(n))), f"1\n0 {n}"


def _parts_upto_3(v: int) -> int:
    """The partitions of v into parts of at most 3: the integer nearest (v + 3)^2 / 12."""
    return ((v + 3) ** 2 + 6) // 12


def _big_coins_full() -> tuple[str, str]:
    """The most coins (100) and the largest amount (10^4): coins 1, 2, 3 and 97 distinct coins above A / 2 (a way
    holds at most one of those), so the count is p3(A) plus p3(A - c) for each large coin c, p3 the partitions into
    parts of at most 3 (~7 * 10^7 ways: a recursion over the coins makes a call per way)."""
    rng = random.Random(100)
    amount = 10000
    large = rng.sample(range(amount // 2 + 1, amount + 1), 97)
    coins = [1, 2, 3] + large
    rng.shuffle(coins)
    total = _parts_upto_3(amount) + sum(_parts_upto_3(amount - c) for c in large)
    return f"{len(coins)} {amount}\n{' '.join(map(str, coins))}\n", str(total % MOD)


def _edit_distance_bits(a: str, b: str) -> int:
    """The edit distance by Hyyro's bit-parallel algorithm (not the reference's table): a column of the table kept
    as bit vectors of its +1 and -1 steps down, updated for each letter of b in a few big-integer operations."""
    m = len(a)
    full, top = (1 << m) - 1, 1 << (m - 1)
    peq: dict[str, int] = {}
    for i, ch in enumerate(a):
        peq[ch] = peq.get(ch, 0) | 1 << i
    pv, mv, dist = full, 0, m
    for ch in b:
        eq = peq.get(ch, 0)
        xv = eq | mv
        xh = (((eq & pv) + pv) ^ pv) | eq
        ph = mv | (~(xh | pv) & full)
        mh = pv & xh
        dist += 1 if ph & top else -1 if mh & top else 0
        ph = ((ph << 1) | 1) & full  # (the first row steps +1 across: D[0][j] = j)
        mh = (mh << 1) & full
        pv = mh | (~(xv | ph) & full)
        mv = ph & xv
    return dist


def _big_edit() -> tuple[str, str]:
    """Two words of 1000 letters (the most allowed) over abcd, the second the first after 150 random substitutions,
    deletions and insertions (cut or padded back to 1000 letters); the recursion on the last letters (three calls
    where they differ) is exponential."""
    rng = random.Random(200)
    n = 1000
    a = [rng.choice("abcd") for _ in range(n)]
    b = list(a)
    for _ in range(150):
        i, kind = rng.randrange(len(b)), rng.randrange(3)
        if kind == 0:
            b[i] = rng.choice("abcd")
        elif kind == 1:
            del b[i]
        else:
            b.insert(i, rng.choice("abcd"))
    b = (b + [rng.choice("abcd") for _ in range(n)])[:n]
    a, b = "".join(a), "".join(b)
    return f"{a}\n{b}\n", str(_edit_distance_bits(a, b))


def _prime_count(n: int) -> int:
    """pi(n) by Lucy's method (not a sieve): S(v), the count of 2..v, for each value v = n // k, and for each prime
    p <= sqrt(n) in turn S(v) -= S(v // p) - S(p - 1) for v >= p^2 (the numbers whose least prime factor is p)."""
    r = math.isqrt(n)
    vals = [n // k for k in range(1, r + 1)]
    vals += range(vals[-1] - 1, 0, -1)
    cnt = {v: v - 1 for v in vals}
    for p in range(2, r + 1):
        if cnt[p] > cnt[p - 1]:  # p is prime
            below, p2 = cnt[p - 1], p * p
            for v in vals:
                if v < p2:
                    break
                cnt[v] -= cnt[v // p] - below
    return cnt[n]


def _big_words() -> tuple[str, str]:
    """10^5 words (the most allowed): 5 * 10^4 four-letter words twice each (the word of x spells x's base-26
    digits, lowest first), then the first and the second word replaced by two others, which so occur three times:
    the alphabetically smaller one wins, the larger one comes first. Counting each word with list.count is
    quadratic."""
    n, k = 100000, 50000

    def word(x: int) -> str:
        return "".join(chr(97 + x // 26 ** d % 26) for d in range(4))

    table = [word(x) for x in range(k)]
    words = [table[i * 7919 % k] for i in range(n)]  # (7919 is prime to k: each x < k twice)
    lo, hi = sorted((word(12345), word(23456)))
    words[0], words[1] = hi, lo  # (were word(0) and word(7919), now once each)
    return " ".join(words) + "\n", f"{lo} 3"


def _big_prefix() -> tuple[str, str]:
    """10^5 numbers whose running sums are chosen first: the i-th is i * 10^8 plus a random part below 9 * 10^8
    (to 10^13: beyond 32 bits), the numbers their differences (-8 * 10^8 to 10^9). Summing each prefix anew is
    quadratic."""
    rng = random.Random(300)
    n = 100000
    sums = [i * 10 ** 8 + rng.randrange(9 * 10 ** 8) for i in range(1, n + 1)]
    a = [sums[0]] + [y - x for x, y in zip(sums, sums[1:])]
    return f"{n}\n{' '.join(map(str, a))}\n", " ".join(map(str, sums))


def _big_second() -> tuple[str, str]:
    """10^5 values: 5 * 10^4 below 123456789 and it three times, in a random order, then the largest, 10^9,
    5 * 10^4 times: the answer is 123456789. Collecting the distinct values in a list, or removing the largest one
    copy at a time, is quadratic."""
    rng = random.Random(400)
    n, second, top = 100000, 123456789, 10 ** 9
    low = [rng.randrange(-10 ** 9, second) for _ in range(n // 2 - 3)] + [second] * 3
    rng.shuffle(low)
    return f"{n}\n{' '.join(map(str, low + [top] * (n - len(low))))}\n", str(second)


def _big_knapsack() -> tuple[str, str]:
    """100 items (the most allowed) of weights 100..199, each worth 7 per unit of weight, W = 10^4: some subset
    weighs exactly 10^4 (the sums of k consecutive integers fill a range: 60 of them reach 7770..10170), so the
    best value is 7 * 10^4."""
    n, cap = 100, 10000
    return f"{n} {cap}\n" + "".join(f"{100 + i} {7 * (100 + i)}\n" for i in range(n)), str(7 * cap)


# --------------------------------------------------------------------------------------------
# the built-in seeds
# --------------------------------------------------------------------------------------------
def _raw() -> list[dict]:
    return [
    dict(id="sum-two", title="Sum of two integers", difficulty=1,
         statement="Given two integers a and b, print their sum.",
         input_spec="One line with two integers a and b (-10^9 <= a, b <= 10^9).",
         output_spec="One integer: a + b.",
         reference="a, b = map(int, input().split())\nprint(a + b)\n",
         wrong=["a, b = map(int, input().split())\nprint(abs(a) + abs(b))\n"],
         validator=_lines(count=1) +
                   "t = [int(x) for x in l[0].split()]\nassert len(t) == 2 and all(abs(x) <= 10**9 for x in t)\n",
         tests=_t(("1 2", "3"), ("-5 3", "-2"), ("1000000000 1000000000", "2000000000"), ("0 0", "0"),
                  ("-7 -8", "-15"))),
    dict(id="max-of-list", title="Maximum", difficulty=1,
         statement="Given a list of integers, print the largest one.",
         input_spec="The first line holds n (1 <= n <= 10^5); the second line holds n integers of absolute value at most 10^9.",
         output_spec="The maximum of the n integers.",
         reference="input()\nprint(max(map(int, input().split())))\n",
         wrong=["input()\nm = 0\nfor x in map(int, input().split()):\n    if x > m:\n        m = x\nprint(m)\n"],
         validator=_v_list(1, 10**5, -10**9, 10**9),
         tests=_t(("5\n3 9 2 9 1", "9"), ("3\n-5 -2 -9", "-2"), ("1\n7", "7"), ("4\n0 0 0 0", "0"), _big_max())),
    dict(id="count-vowels", title="Vowels", difficulty=1,
         statement="Count the vowels (a, e, i, o, u) in a word. The letter y is not a vowel.",
         input_spec="One word of 1 to 1000 lowercase English letters.",
         output_spec="The number of vowels in the word.",
         reference="print(sum(c in 'aeiou' for c in input().strip()))\n",
         wrong=["print(sum(c in 'aeiouy' for c in input().strip()))\n"],
         validator=_v_word(1, 1000),
         tests=_t(("hello", "2"), ("rhythm", "0"), ("aeiouy", "5"), ("programming", "3"), ("queue", "4"))),
    dict(id="reverse-words", title="Reverse the words", difficulty=1,
         statement="Print the words of a sentence in reverse order.",
         input_spec="One line of 1 to 100 words of lowercase letters separated by single spaces.",
         output_spec="The same words in reverse order, separated by single spaces.",
         reference="print(' '.join(input().split()[::-1]))\n",
         wrong=["print(input().strip()[::-1])\n"],
         validator=_lines(count=1) +
                   "t = l[0].split()\nassert 1 <= len(t) <= 100\nassert all(w.isalpha() and w.islower() for w in t)\n",
         tests=_t(("hello world", "world hello"), ("a b c", "c b a"), ("single", "single"),
                  ("the quick brown fox", "fox brown quick the"))),
    dict(id="fizzbuzz", title="FizzBuzz", difficulty=1,
         statement="For each i from 1 to n print Fizz if i is divisible by 3 only, Buzz if by 5 only, "
                   "FizzBuzz if by both, and i itself otherwise.",
         input_spec="One integer n (1 <= n <= 1000).",
         output_spec="n lines.",
         reference="n = int(input())\nfor i in range(1, n + 1):\n    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 "
                   "else 'Buzz' if i % 5 == 0 else i)\n",
         wrong=["n = int(input())\nfor i in range(1, n + 1):\n    print('Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 "
                "else 'FizzBuzz' if i % 15 == 0 else i)\n"],
         validator="import sys\nt = sys.stdin.read().split()\nassert len(t) == 1 and 1 <= int(t[0]) <= 1000\n",
         tests=_t(("5", "1\n2\nFizz\n4\nBuzz"), ("1", "1"), ("3", "1\n2\nFizz"),
                  ("15", "1\n2\nFizz\n4\nBuzz\nFizz\n7\n8\nFizz\nBuzz\n11\nFizz\n13\n14\nFizzBuzz"))),
    dict(id="even-sum", title="Sum of the even numbers", difficulty=1,
         statement="Print the sum of the even numbers of a list (values, not positions).",
         input_spec="The first line holds n (1 <= n <= 10^5); the second line n integers of absolute value at most 10^9.",
         output_spec="One integer.",
         reference="input()\nprint(sum(x for x in map(int, input().split()) if x % 2 == 0))\n",
         wrong=["def i32(v):\n    return (v + 2**31) % 2**32 - 2**31\ninput()\ns = 0\nfor x in map(int, input().split()):\n    if x % 2 == 0:\n        s = i32(s + x)\nprint(s)\n",  # 32-bit
                "input()\na = list(map(int, input().split()))\nprint(sum(a[i] for i in range(0, len(a), 2)))\n"],
         validator=_v_list(1, 10**5, -10**9, 10**9),
         tests=_t(("5\n1 2 3 4 5", "6"), ("4\n-2 -3 7 8", "6"), ("3\n1 3 5", "0"), ("1\n0", "0"),
                  ("6\n10 10 10 1 1 1", "30"), (_BILLIONS, "3000000000"))),
    dict(id="palindrome", title="Palindrome", difficulty=1,
         statement="Decide whether a word reads the same forwards and backwards.",
         input_spec="One word of 1 to 1000 lowercase letters.",
         output_spec="YES or NO.",
         reference="s = input().strip()\nprint('YES' if s == s[::-1] else 'NO')\n",
         wrong=["s = input().strip()\nprint('YES' if s[0] == s[-1] else 'NO')\n"],
         validator=_v_word(1, 1000),
         tests=_t(("racecar", "YES"), ("abca", "NO"), ("a", "YES"), ("ab", "NO"), ("abba", "YES"))),
    dict(id="gcd", title="Greatest common divisor", difficulty=1,
         statement="Print the greatest common divisor of two positive integers.",
         input_spec="Two integers a and b (1 <= a, b <= 10^12).",
         output_spec="gcd(a, b).",
         reference="a, b = map(int, input().split())\nwhile b:\n    a, b = b, a % b\nprint(a)\n",
         wrong=["a, b = map(int, input().split())\nlo, hi = min(a, b), max(a, b)\nprint(lo if hi % lo == 0 else 1)\n"],
         validator=_lines(count=1) +
                   "t = [int(x) for x in l[0].split()]\nassert len(t) == 2 and all(1 <= x <= 10**12 for x in t)\n",
         tests=_t(("12 18", "6"), ("7 13", "1"), ("100 10", "10"), ("1 1", "1"),
                  ("1000000000000 999999999999", "1"))),
    dict(id="second-largest", title="Second largest distinct value", difficulty=2,
         statement="Print the second largest distinct value of a list, or NONE if the list has fewer than two distinct values.",
         input_spec="The first line holds n (1 <= n <= 10^5); the second line n integers of absolute value at most 10^9.",
         output_spec="One integer or NONE.",
         reference="input()\nv = sorted(set(map(int, input().split())))\nprint(v[-2] if len(v) >= 2 else 'NONE')\n",
         wrong=["n = int(input())\na = sorted(map(int, input().split()))\nprint(a[-2] if n >= 2 else 'NONE')\n"],
         validator=_v_list(1, 10**5, -10**9, 10**9),
         tests=_t(("5\n3 1 4 1 5", "4"), ("3\n7 7 7", "NONE"), ("4\n9 9 8 8", "8"), ("1\n5", "NONE"),
                  ("5\n-1 -2 -3 -4 -5", "-2"), _big_second())),
    dict(id="prime-check", title="Is it prime?", difficulty=1,
         statement="Decide whether n is a prime number.",
         input_spec="One integer n (1 <= n <= 10^9).",
         output_spec="YES or NO.",
         reference="n = int(input())\nok = n >= 2\nd = 2\nwhile d * d <= n and ok:\n    ok = n % d != 0\n    d += 1\nprint('YES' if ok else 'NO')\n",
         wrong=["n = int(input())\nok = True\nd = 2\nwhile d * d <= n and ok:\n    ok = n % d != 0\n    d += 1\nprint('YES' if ok else 'NO')\n"],
         validator="import sys\nt = sys.stdin.read().split()\nassert len(t) == 1 and 1 <= int(t[0]) <= 10**9\n",
         tests=_t(("2", "YES"), ("1", "NO"), ("97", "YES"), ("100", "NO"), ("999999937", "YES"), ("25", "NO"))),
    dict(id="count-primes", title="Counting primes", difficulty=2,
         statement="Count the primes that are less than or equal to n.",
         input_spec="One integer n (1 <= n <= 10^6).",
         output_spec="The number of primes p <= n.",
         reference="n = int(input())\ns = bytearray([1]) * (n + 1)\ns[0:2] = b'\\x00\\x00'[:n + 1]\n"
                   "i = 2\nwhile i * i <= n:\n    if s[i]:\n        s[i * i::i] = bytearray(len(range(i * i, n + 1, i)))\n    i += 1\n"
                   "print(sum(s))\n",
         wrong=["n = int(input())\ns = bytearray([1]) * (n + 1)\ns[0:2] = b'\\x00\\x00'[:n + 1]\n"
                "i = 2\nwhile i * i <= n:\n    if s[i]:\n        s[i * i::i] = bytearray(len(range(i * i, n + 1, i)))\n    i += 1\n"
                "print(sum(s[:n]))\n"],
         validator="import sys\nt = sys.stdin.read().split()\nassert len(t) == 1 and 1 <= int(t[0]) <= 10**6\n",
         tests=_t(("10", "4"), ("1", "0"), ("2", "1"), ("100", "25"), ("1000000", "78498"),
                  # (four tests at the stated size: code/arc shows at most three tests of a seed of this tier)
                  *((str(n), str(_prime_count(n))) for n in (999983, 987654, 999999)))),
    dict(id="balanced-brackets", title="Balanced brackets", difficulty=2,
         statement="Decide whether a string of brackets ()[]{} is balanced: every opening bracket is closed "
                   "by the matching bracket in the right order.",
         input_spec="One string of 1 to 10^5 characters, each one of ()[]{}.",
         output_spec="YES or NO.",
         reference="s = input().strip()\nst = []\npair = {')': '(', ']': '[', '}': '{'}\nok = True\nfor c in s:\n"
                   "    if c in '([{':\n        st.append(c)\n    elif not st or st.pop() != pair[c]:\n        ok = False\n        break\n"
                   "print('YES' if ok and not st else 'NO')\n",
         wrong=["s = input().strip()\nok = all(s.count(a) == s.count(b) for a, b in ('()', '[]', '{}'))\n"
                "print('YES' if ok else 'NO')\n"],
         validator=_v_word(1, 10**5, alphabet="()[]{}"),
         tests=_t(("()[]{}", "YES"), ("([)]", "NO"), ("((", "NO"), ("{[()]}", "YES"), (")(", "NO"), *_big_brackets())),
    dict(id="transpose", title="Transpose a matrix", difficulty=1,
         statement="Print the transpose of an r x c integer matrix.",
         input_spec="The first line holds r and c (1 <= r, c <= 100); then r lines of c integers each.",
         output_spec="c lines of r integers: the transpose.",
         reference="r, c = map(int, input().split())\nm = [input().split() for _ in range(r)]\n"
                   "for j in range(c):\n    print(' '.join(m[i][j] for i in range(r)))\n",
         wrong=["r, c = map(int, input().split())\nm = [input().split() for _ in range(r)]\n"
                "for j in range(r):\n    print(' '.join(m[i][j] for i in range(r)))\n"],
         validator="import sys\nl = sys.stdin.read().split('\\n')\nr, c = map(int, l[0].split())\nassert 1 <= r <= 100 and 1 <= c <= 100\n"
                   "for i in range(1, r + 1):\n    assert len([int(x) for x in l[i].split()]) == c\n"
                   "assert all(not x.strip() for x in l[r + 1:])\n",
         tests=_t(("2 3\n1 2 3\n4 5 6", "1 4\n2 5\n3 6"), ("1 1\n7", "7"), ("3 1\n1\n2\n3", "1 2 3"),
                  ("2 2\n1 2\n3 4", "1 3\n2 4"))),
    dict(id="prefix-sums", title="Running sums", difficulty=1,
         statement="Print the running sums of a list: the i-th number printed is the sum of the first i numbers.",
         input_spec="The first line holds n (1 <= n <= 10^5); the second line n integers of absolute value at most 10^9.",
         output_spec="n integers on one line.",
         reference="input()\ns = 0\nout = []\nfor x in map(int, input().split()):\n    s += x\n    out.append(s)\nprint(*out)\n",
         wrong=["def i32(v):\n    return (v + 2**31) % 2**32 - 2**31\ninput()\ns = 0\nout = []\nfor x in map(int, input().split()):\n    s = i32(s + x)\n    out.append(s)\nprint(*out)\n",  # 32-bit
                "input()\ns = 0\nout = []\nfor x in map(int, input().split()):\n    out.append(s)\n    s += x\nprint(*out)\n"],
         validator=_v_list(1, 10**5, -10**9, 10**9),
         tests=_t(("4\n1 2 3 4", "1 3 6 10"), ("1\n-5", "-5"), ("3\n0 0 0", "0 0 0"), ("5\n5 -5 5 -5 5", "5 0 5 0 5"),
                  ("3\n2 -1 4", "2 1 5"), (_BILLIONS, "1000000000 2000000000 3000000000"), _big_prefix())),
    dict(id="binary-to-decimal", title="Binary to decimal", difficulty=1,
         statement="Convert a binary number to decimal.",
         input_spec="A binary string of 1 to 60 digits without leading zeros (or the single digit 0).",
         output_spec="Its value in decimal.",
         reference="print(int(input().strip(), 2))\n",
         wrong=["print(int(input().strip(), 2) % 2**32)\n",  # 32-bit unsigned
                "print(int(input().strip()[::-1], 2))\n"],
         validator="import sys\nt = sys.stdin.read().split()\nassert len(t) == 1 and 1 <= len(t[0]) <= 60 and set(t[0]) <= set('01')\n"
                   "assert t[0] == '0' or t[0][0] == '1'\n",
         tests=_t(("101", "5"), ("0", "0"), ("1", "1"), ("1101", "13"), ("100000", "32"), ("1" * 60, str(2**60 - 1)))),
    dict(id="anagram", title="Anagrams", difficulty=1,
         statement="Decide whether two words are anagrams (the same letters, each the same number of times).",
         input_spec="One line with two words of 1 to 1000 lowercase letters.",
         output_spec="YES or NO.",
         reference="a, b = input().split()\nprint('YES' if sorted(a) == sorted(b) else 'NO')\n",
         wrong=["a, b = input().split()\nprint('YES' if set(a) == set(b) else 'NO')\n"],
         validator=_v_word(1, 1000, words=2),
         tests=_t(("listen silent", "YES"), ("aab abb", "NO"), ("abc cba", "YES"), ("a a", "YES"), ("ab abc", "NO"))),
    dict(id="longest-run", title="Longest increasing run", difficulty=2,
         statement="Print the length of the longest contiguous run of strictly increasing numbers.",
         input_spec="The first line holds n (1 <= n <= 10^5); the second line n integers of absolute value at most 10^9.",
         output_spec="One integer.",
         reference="input()\na = list(map(int, input().split()))\nbest = cur = 1\nfor i in range(1, len(a)):\n"
                   "    cur = cur + 1 if a[i] > a[i - 1] else 1\n    best = max(best, cur)\nprint(best)\n",
         wrong=["input()\na = list(map(int, input().split()))\nbest = cur = 1\nfor i in range(1, len(a)):\n"
                "    cur = cur + 1 if a[i] >= a[i - 1] else 1\n    best = max(best, cur)\nprint(best)\n"],
         validator=_v_list(1, 10**5, -10**9, 10**9),
         tests=_t(("6\n1 2 2 3 4 1", "3"), ("1\n5", "1"), ("5\n5 4 3 2 1", "1"), ("5\n1 2 3 4 5", "5"), ("4\n1 1 1 1", "1"),
                  ("5\n3 1 2 3 0", "3"), _big_list(_longest_run))),
    dict(id="pair-sum-count", title="Pairs with a given sum", difficulty=2,
         statement="Count the pairs of positions i < j with a_i + a_j = k.",
         input_spec="The first line holds n and k (1 <= n <= 10^5, |k| <= 2*10^9); the second line n integers of absolute value at most 10^9.",
         output_spec="The number of pairs.",
         reference="n, k = map(int, input().split())\nseen = {}\nans = 0\nfor x in map(int, input().split()):\n"
                   "    ans += seen.get(k - x, 0)\n    seen[x] = seen.get(x, 0) + 1\nprint(ans)\n",
         wrong=["from collections import Counter\nn, k = map(int, input().split())\na = list(map(int, input().split()))\n"
                "c = Counter(a)\nprint(sum(c[k - x] for x in a) // 2)\n"],
         validator=_v_list(1, 10**5, -10**9, 10**9, head=1, head_lo=-2 * 10**9, head_hi=2 * 10**9),
         tests=_t(("4 5\n1 4 2 3", "2"), ("3 4\n2 2 2", "3"), ("1 2\n1", "0"), ("5 0\n-1 1 0 0 2", "2"), _big_pairs())),
    dict(id="kth-smallest", title="k-th smallest", difficulty=2,
         statement="Print the k-th smallest element of a list (counting from 1, duplicates counted separately).",
         input_spec="The first line holds n and k (1 <= k <= n <= 10^5); the second line n integers of absolute value at most 10^9.",
         output_spec="One integer.",
         reference="n, k = map(int, input().split())\nprint(sorted(map(int, input().split()))[k - 1])\n",
         wrong=["n, k = map(int, input().split())\nprint(sorted(map(int, input().split()))[min(k, n - 1)])\n"],
         validator=_lines(count=2, first=2) +
                   "t = [int(x) for x in s.split()]\nn, k = t[0], t[1]\n"
                   "assert 1 <= k <= n <= 10**5 and len(t) == n + 2 and all(abs(x) <= 10**9 for x in t[2:])\n",
         tests=_t(("5 2\n5 1 4 2 3", "2"), ("3 3\n7 7 1", "7"), ("1 1\n-4", "-4"), ("4 1\n10 -10 0 5", "-10"),
                  _big_kth())),
    dict(id="lis-length", title="Longest increasing subsequence", difficulty=3,
         statement="Print the length of the longest strictly increasing subsequence (not necessarily contiguous).",
         input_spec="The first line holds n (1 <= n <= 2*10^5); the second line n integers of absolute value at most 10^9.",
         output_spec="One integer.",
         reference="import bisect\ninput()\nt = []\nfor x in map(int, input().split()):\n    i = bisect.bisect_left(t, x)\n"
                   "    if i == len(t):\n        t.append(x)\n    else:\n        t[i] = x\nprint(len(t))\n",
         wrong=["import bisect\ninput()\nt = []\nfor x in map(int, input().split()):\n    i = bisect.bisect_right(t, x)\n"
                "    if i == len(t):\n        t.append(x)\n    else:\n        t[i] = x\nprint(len(t))\n"],
         validator=_v_list(1, 2 * 10**5, -10**9, 10**9),
         tests=_t(("6\n10 9 2 5 3 7", "3"), ("5\n1 1 1 1 1", "1"), ("8\n0 8 4 12 2 10 6 14", "4"), ("1\n5", "1"),
                  ("5\n1 2 2 3 3", "3"), _big_lis())),
    dict(id="coin-change-ways", title="Ways to pay", difficulty=3,
         statement="Count the ways to pay an amount with unlimited coins of the given distinct values; two ways "
                   "that use the same coins in a different order are the same way. Print the count modulo 1000000007.",
         input_spec="The first line holds n and the amount A (1 <= n <= 100, 0 <= A <= 10^4); the second line n distinct coin values (1 to 10^4).",
         output_spec="The number of ways modulo 1000000007.",
         reference="n, A = map(int, input().split())\nways = [1] + [0] * A\nfor c in map(int, input().split()):\n"
                   "    for v in range(c, A + 1):\n        ways[v] = (ways[v] + ways[v - c]) % 1000000007\nprint(ways[A])\n",
         wrong=["n, A = map(int, input().split())\ncoins = list(map(int, input().split()))\nways = [1] + [0] * A\n"
                "for v in range(1, A + 1):\n    for c in coins:\n        if c <= v:\n            ways[v] = (ways[v] + ways[v - c]) % 1000000007\n"
                "print(ways[A])\n"],
         validator=_lines(count=2, first=2) +
                   "t = [int(x) for x in s.split()]\nn, A = t[0], t[1]\nc = t[2:]\n"
                   "assert 1 <= n <= 100 and 0 <= A <= 10**4 and len(c) == n and len(set(c)) == n and all(1 <= x <= 10**4 for x in c)\n",
         tests=_t(("3 5\n1 2 5", "4"), ("1 3\n2", "0"), ("1 0\n7", "1"), ("2 4\n1 2", "3"), _big_coins(),
                  _big_coins_full())),
    dict(id="edit-distance", title="Edit distance", difficulty=3,
         statement="Print the least number of single-letter insertions, deletions and substitutions that turn the first word into the second.",
         # (1000 letters: the reference's table takes ~0.4 s; at 2000, ~1.5 s of the 2 s limit)
         input_spec="Two lines, each one word of 1 to 1000 lowercase letters.",
         output_spec="One integer.",
         reference="a = input().strip()\nb = input().strip()\nprev = list(range(len(b) + 1))\nfor i, x in enumerate(a, 1):\n"
                   "    cur = [i]\n    for j, y in enumerate(b, 1):\n        cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))\n"
                   "    prev = cur\nprint(prev[-1])\n",
         wrong=["a = input().strip()\nb = input().strip()\nprev = [0] * (len(b) + 1)\nfor x in a:\n    cur = [0]\n"
                "    for j, y in enumerate(b, 1):\n        cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))\n"
                "    prev = cur\nprint(len(a) + len(b) - 2 * prev[-1])\n"],
         validator=_v_word(1, 1000, words=2, per_line=True),
         tests=_t(("kitten\nsitting", "3"), ("abc\nabc", "0"), ("a\nb", "1"), ("intention\nexecution", "5"), ("ab\nba", "2"),
                  _big_edit())),
    dict(id="grid-paths", title="Paths in a grid", difficulty=3,
         statement="A grid has free cells '.' and walls '#'. Count the paths from the top-left to the bottom-right "
                   "cell that move only right or down through free cells, modulo 1000000007.",
         input_spec="The first line holds r and c (1 <= r, c <= 100); then r lines of c characters.",
         output_spec="The number of paths modulo 1000000007 (0 if a corner is a wall).",
         reference="r, c = map(int, input().split())\ng = [input().strip() for _ in range(r)]\ndp = [[0] * c for _ in range(r)]\n"
                   "for i in range(r):\n    for j in range(c):\n        if g[i][j] == '#':\n            continue\n"
                   "        if i == 0 and j == 0:\n            dp[i][j] = 1\n            continue\n"
                   "        dp[i][j] = ((dp[i - 1][j] if i else 0) + (dp[i][j - 1] if j else 0)) % 1000000007\nprint(dp[-1][-1])\n",
         wrong=["r, c = map(int, input().split())\ng = [input().strip() for _ in range(r)]\ndp = [[0] * c for _ in range(r)]\n"
                "dp[0][0] = 1\nfor i in range(r):\n    for j in range(c):\n        if (i or j) and g[i][j] == '.':\n"
                "            dp[i][j] = ((dp[i - 1][j] if i else 0) + (dp[i][j - 1] if j else 0)) % 1000000007\nprint(dp[-1][-1])\n"],
         validator=_lines(first=2, rest=1) +
                   "l = s.split()\nr, c = int(l[0]), int(l[1])\nassert 1 <= r <= 100 and 1 <= c <= 100\n"
                   "assert len(l) == r + 2 and all(len(x) == c and set(x) <= set('.#') for x in l[2:])\n",
         tests=_t(("2 2\n..\n..", "2"), ("3 3\n...\n.#.\n...", "2"), ("1 1\n.", "1"), ("2 2\n#.\n..", "0"), ("3 3\n...\n...\n...", "6"),
                  _big_grid())),
    dict(id="components", title="Connected components", difficulty=3,
         statement="Count the connected components of an undirected graph with vertices 1..n.",
         input_spec="The first line holds n and m (1 <= n <= 10^5, 0 <= m <= 2*10^5); then m lines with an edge u v each.",
         output_spec="The number of connected components.",
         reference="import sys\nt = sys.stdin.buffer.read().split()\nn, m = int(t[0]), int(t[1])\np = list(range(n + 1))\n"
                   "def f(x):\n    while p[x] != x:\n        p[x] = p[p[x]]\n        x = p[x]\n    return x\ncomp = n\n"
                   "for i in range(m):\n    a, b = f(int(t[2 + 2 * i])), f(int(t[3 + 2 * i]))\n    if a != b:\n        p[a] = b\n        comp -= 1\nprint(comp)\n",
         wrong=["import sys\nt = sys.stdin.buffer.read().split()\nn, m = int(t[0]), int(t[1])\np = {}\n"
                "def f(x):\n    p.setdefault(x, x)\n    while p[x] != x:\n        x = p[x]\n    return x\n"
                "for i in range(m):\n    a, b = f(int(t[2 + 2 * i])), f(int(t[3 + 2 * i]))\n    if a != b:\n        p[a] = b\n"
                "print(sum(1 for x in p if f(x) == x))\n"],
         validator=_V_GRAPH.format(k=2),
         tests=_t(("5 2\n1 2\n3 4", "3"), ("3 0", "3"), ("4 3\n1 2\n2 3\n3 4", "1"), ("1 0", "1"),
                  ("6 3\n1 2\n2 1\n5 6", "4"), _big_chain())),
    dict(id="bfs-distance", title="Fewest edges", difficulty=3,
         statement="In an undirected graph with vertices 1..n, print the least number of edges on a path from 1 to n, or -1 if there is none.",
         input_spec="The first line holds n and m (1 <= n <= 10^5, 0 <= m <= 2*10^5); then m lines with an edge u v each.",
         output_spec="One integer.",
         reference="import sys\nfrom collections import deque\nt = sys.stdin.buffer.read().split()\nn, m = int(t[0]), int(t[1])\n"
                   "g = [[] for _ in range(n + 1)]\nfor i in range(m):\n    a, b = int(t[2 + 2 * i]), int(t[3 + 2 * i])\n    g[a].append(b)\n    g[b].append(a)\n"
                   "d = [-1] * (n + 1)\nd[1] = 0\nq = deque([1])\nwhile q:\n    u = q.popleft()\n    for v in g[u]:\n"
                   "        if d[v] < 0:\n            d[v] = d[u] + 1\n            q.append(v)\nprint(d[n])\n",
         wrong=["import sys\nfrom collections import deque\nt = sys.stdin.buffer.read().split()\nn, m = int(t[0]), int(t[1])\n"
                "g = [[] for _ in range(n + 1)]\nfor i in range(m):\n    a, b = int(t[2 + 2 * i]), int(t[3 + 2 * i])\n    g[a].append(b)\n"
                "d = [-1] * (n + 1)\nd[1] = 0\nq = deque([1])\nwhile q:\n    u = q.popleft()\n    for v in g[u]:\n"
                "        if d[v] < 0:\n            d[v] = d[u] + 1\n            q.append(v)\nprint(d[n])\n"],
         validator=_V_GRAPH.format(k=2),
         tests=_t(("4 4\n1 2\n2 3\n3 4\n1 3", "2"), ("3 1\n1 2", "-1"), ("2 1\n2 1", "1"), ("1 0", "0"),
                  ("5 4\n5 4\n4 3\n3 2\n2 1", "4"), _big_path(False))),
    dict(id="dijkstra", title="Shortest road", difficulty=3,
         statement="Roads join towns 1..n; each road has a length. Print the length of the shortest route from town 1 to town n, or -1 if there is none.",
         input_spec="The first line holds n and m (1 <= n <= 10^5, 0 <= m <= 2*10^5); then m lines u v w: a two-way road of length w (1 <= w <= 10^9).",
         output_spec="One integer.",
         reference="import sys, heapq\nt = sys.stdin.buffer.read().split()\nn, m = int(t[0]), int(t[1])\ng = [[] for _ in range(n + 1)]\n"
                   "for i in range(m):\n    a, b, w = int(t[2 + 3 * i]), int(t[3 + 3 * i]), int(t[4 + 3 * i])\n    g[a].append((b, w))\n    g[b].append((a, w))\n"
                   "INF = float('inf')\nd = [INF] * (n + 1)\nd[1] = 0\nh = [(0, 1)]\nwhile h:\n    du, u = heapq.heappop(h)\n    if du > d[u]:\n        continue\n"
                   "    for v, w in g[u]:\n        if du + w < d[v]:\n            d[v] = du + w\n            heapq.heappush(h, (d[v], v))\n"
                   "print(d[n] if d[n] < INF else -1)\n",
         wrong=["import sys, heapq\nt = sys.stdin.buffer.read().split()\nn, m = int(t[0]), int(t[1])\ng = [[] for _ in range(n + 1)]\nfor i in range(m):\n    a, b, w = int(t[2 + 3 * i]), int(t[3 + 3 * i]), int(t[4 + 3 * i])\n    g[a].append((b, w))\nd = [float('inf')] * (n + 1)\nd[1] = 0\nh = [(0, 1)]\nwhile h:\n    du, u = heapq.heappop(h)\n    if du > d[u]:\n        continue\n    for v, w in g[u]:\n        if du + w < d[v]:\n            d[v] = du + w\n            heapq.heappush(h, (d[v], v))\nprint(d[n] if d[n] < float('inf') else -1)\n",  # roads one way
                "import sys\nfrom collections import deque\nt = sys.stdin.buffer.read().split()\nn, m = int(t[0]), int(t[1])\n"
                "g = [[] for _ in range(n + 1)]\nfor i in range(m):\n    a, b, w = int(t[2 + 3 * i]), int(t[3 + 3 * i]), int(t[4 + 3 * i])\n"
                "    g[a].append((b, w))\n    g[b].append((a, w))\nd = [-1] * (n + 1)\nd[1] = 0\nq = deque([1])\nwhile q:\n    u = q.popleft()\n"
                "    for v, w in g[u]:\n        if d[v] < 0:\n            d[v] = d[u] + w\n            q.append(v)\nprint(d[n])\n"],
         validator=_V_GRAPH.format(k=3),
         tests=_t(("3 3\n1 2 1\n2 3 1\n1 3 5", "2"), ("2 0", "-1"), ("4 4\n1 2 5\n1 3 1\n3 2 1\n2 4 1", "3"), ("1 0", "0"),
                  ("3 2\n1 2 1000000000\n2 3 1000000000", "2000000000"), ("3 2\n2 1 4\n3 2 1", "5"),  # (both ways)
                  _big_path(True))),
    dict(id="knapsack", title="Knapsack", difficulty=3,
         statement="Choose items, each at most once, of total weight at most W and the largest total value. Print that value.",
         input_spec="The first line holds n and W (1 <= n <= 100, 0 <= W <= 10^4); then n lines with the weight (1 to 10^4) and value (0 to 10^6) of an item.",
         output_spec="The largest total value.",
         reference="n, W = map(int, input().split())\nbest = [0] * (W + 1)\nfor _ in range(n):\n    w, v = map(int, input().split())\n"
                   "    for c in range(W, w - 1, -1):\n        best[c] = max(best[c], best[c - w] + v)\nprint(best[W])\n",
         wrong=["n, W = map(int, input().split())\nbest = [0] * (W + 1)\nfor _ in range(n):\n    w, v = map(int, input().split())\n"
                "    for c in range(w, W + 1):\n        best[c] = max(best[c], best[c - w] + v)\nprint(best[W])\n"],
         validator=_lines(first=2, rest=2) +
                   "t = [int(x) for x in s.split()]\nn, W = t[0], t[1]\n"
                   "assert 1 <= n <= 100 and 0 <= W <= 10**4 and len(t) == 2 + 2 * n\n"
                   "assert all(1 <= t[2 + 2 * i] <= 10**4 and 0 <= t[3 + 2 * i] <= 10**6 for i in range(n))\n",
         tests=_t(("3 4\n1 1\n3 4\n4 5", "5"), ("1 5\n6 10", "0"), ("3 10\n5 10\n4 40\n6 30", "70"), ("2 3\n1 2\n1 3", "5"),
                  _big_knapsack())),
    dict(id="max-subarray", title="Best contiguous sum", difficulty=2,
         statement="Print the largest sum of a non-empty contiguous part of a list.",
         input_spec="The first line holds n (1 <= n <= 10^5); the second line n integers of absolute value at most 10^9.",
         output_spec="One integer.",
         reference="input()\nbest = cur = None\nfor x in map(int, input().split()):\n    cur = x if cur is None or cur < 0 else cur + x\n"
                   "    best = cur if best is None else max(best, cur)\nprint(best)\n",
         wrong=["def i32(v):\n    return (v + 2**31) % 2**32 - 2**31\ninput()\nbest = cur = None\nfor x in map(int, input().split()):\n    cur = x if cur is None or cur < 0 else i32(cur + x)\n    best = cur if best is None else max(best, cur)\nprint(best)\n",  # 32-bit
                "input()\nbest = cur = 0\nfor x in map(int, input().split()):\n    cur = max(0, cur + x)\n    best = max(best, cur)\nprint(best)\n"],
         validator=_v_list(1, 10**5, -10**9, 10**9),
         tests=_t(("9\n-2 1 -3 4 -1 2 1 -5 4", "6"), ("3\n-3 -1 -2", "-1"), ("1\n5", "5"), ("4\n1 2 3 4", "10"),
                  (_BILLIONS, "3000000000"), _big_list(_kadane))),
    dict(id="rotate-right", title="Rotate a list", difficulty=1,
         statement="Rotate a list to the right by k positions (the last element moves to the front, k times).",
         input_spec="The first line holds n and k (1 <= n <= 10^5, 0 <= k <= 10^9); the second line n integers.",
         output_spec="The rotated list on one line.",
         reference="n, k = map(int, input().split())\na = input().split()\nk %= n\nprint(' '.join(a[n - k:] + a[:n - k]))\n",
         wrong=["n, k = map(int, input().split())\na = input().split()\nprint(' '.join(a[-k:] + a[:-k]) if k else ' '.join(a))\n"],
         validator=_v_list(1, 10**5, -10**9, 10**9, head=1, head_lo=0, head_hi=10**9),
         tests=_t(("5 2\n1 2 3 4 5", "4 5 1 2 3"), ("3 4\n1 2 3", "3 1 2"), ("1 100\n7", "7"), ("4 0\n1 2 3 4", "1 2 3 4"),
                  ("3 7\n1 2 3", "3 1 2"), _big_rotate())),
    dict(id="run-length", title="Run-length encoding", difficulty=1,
         statement="Encode a word by writing each maximal run of one letter as the letter followed by the run's length.",
         input_spec="One word of 1 to 1000 lowercase letters.",
         output_spec="The encoding, e.g. aaabcc becomes a3b1c2.",
         reference="s = input().strip()\nout = []\ni = 0\nwhile i < len(s):\n    j = i\n    while j < len(s) and s[j] == s[i]:\n        j += 1\n"
                   "    out.append(s[i] + str(j - i))\n    i = j\nprint(''.join(out))\n",
         wrong=["s = input().strip()\nout = []\nstart = 0\nfor i in range(1, len(s)):\n    if s[i] != s[i - 1]:\n"
                "        out.append(s[start] + str(i - start))\n        start = i\nprint(''.join(out))\n"],
         validator=_v_word(1, 1000),
         tests=_t(("aaabcc", "a3b1c2"), ("a", "a1"), ("abc", "a1b1c1"), ("zzzzzzzzzzzz", "z12"))),
    dict(id="digital-root", title="Digital root", difficulty=1,
         statement="Replace n by the sum of its decimal digits until a single digit remains; print that digit.",
         input_spec="One integer n (0 <= n <= 10^18).",
         output_spec="One digit.",
         reference="n = int(input())\nwhile n >= 10:\n    n = sum(map(int, str(n)))\nprint(n)\n",
         wrong=["n = input().strip()\nprint(sum(map(int, n)))\n"],
         validator="import sys\nt = sys.stdin.read().split()\nassert len(t) == 1 and t[0].isdigit() and 0 <= int(t[0]) <= 10**18\n",
         tests=_t(("38", "2"), ("0", "0"), ("9", "9"), ("999999999999999999", "9"), ("12345", "6"))),
    dict(id="merge-intervals", title="Merge intervals", difficulty=2,
         statement="Merge closed intervals that overlap or touch (like [1,3] and [3,5]); print how many remain and "
                   "then the merged intervals in increasing order.",
         input_spec="The first line holds n (1 <= n <= 10^5); then n lines l r (0 <= l <= r <= 10^9).",
         output_spec="The count on the first line, then one merged interval l r per line.",
         reference="n = int(input())\niv = sorted(tuple(map(int, input().split())) for _ in range(n))\nout = []\nfor l, r in iv:\n"
                   "    if out and l <= out[-1][1]:\n        out[-1][1] = max(out[-1][1], r)\n    else:\n        out.append([l, r])\n"
                   "print(len(out))\nfor l, r in out:\n    print(l, r)\n",
         wrong=["n = int(input())\niv = sorted(tuple(map(int, input().split())) for _ in range(n))\nout = []\nfor l, r in iv:\n    if out and l <= out[-1][1] + 1:\n        out[-1][1] = max(out[-1][1], r)\n    else:\n        out.append([l, r])\nprint(len(out))\nfor l, r in out:\n    print(l, r)\n",  # merges [1,2] and [3,4]
                "n = int(input())\niv = [tuple(map(int, input().split())) for _ in range(n)]\nout = []\nfor l, r in iv:\n"
                "    if out and l <= out[-1][1]:\n        out[-1][1] = max(out[-1][1], r)\n    else:\n        out.append([l, r])\n"
                "print(len(out))\nfor l, r in out:\n    print(l, r)\n"],
         validator=_lines(first=1, rest=2) +
                   "t = [int(x) for x in s.split()]\nn = t[0]\nassert 1 <= n <= 10**5 and len(t) == 1 + 2 * n\n"
                   "assert all(0 <= t[1 + 2 * i] <= t[2 + 2 * i] <= 10**9 for i in range(n))\n",
         tests=_t(("3\n1 3\n2 6\n8 10", "2\n1 6\n8 10"), ("2\n5 7\n1 2", "2\n1 2\n5 7"), ("2\n1 3\n3 5", "1\n1 5"),
                  ("3\n1 10\n2 3\n4 5", "1\n1 10"), ("2\n1 2\n3 4", "2\n1 2\n3 4"),  # (one apart: not touching)
                  _big_intervals())),
    dict(id="word-frequency", title="Most frequent word", difficulty=2,
         statement="Print the most frequent word of a text and its count; among equally frequent words print the "
                   "alphabetically smallest.",
         # (10^5 words: at 10^4, counting each word with list.count took ~1 s, within the time limit)
         input_spec="One line of 1 to 10^5 words of lowercase letters separated by spaces.",
         output_spec="The word and its count, separated by a space.",
         reference="from collections import Counter\nc = Counter(input().split())\nw = min(c, key=lambda x: (-c[x], x))\nprint(w, c[w])\n",
         wrong=["from collections import Counter\nc = Counter(input().split())\nw, k = c.most_common(1)[0]\nprint(w, k)\n"],
         validator=_lines(count=1) +
                   "t = l[0].split()\nassert 1 <= len(t) <= 10**5 and all(w.isalpha() and w.islower() for w in t)\n",
         tests=_t(("the cat and the hat", "the 2"), ("b a", "a 1"), ("x x y y", "x 2"), ("hello", "hello 1"),
                  ("d c b a d c", "c 2"), _big_words())),
]


_CACHE: list[Seed] | None = None


def builtin_seeds() -> list[Seed]:
    """The built-in seed problems (built once)."""
    global _CACHE
    if _CACHE is None:
        _CACHE = seeds_from_dicts(_raw(), "envs.code.seeds")
    return list(_CACHE)
