"""Strings and sequences: palindromes, encodings, rotations, matching and counting substrings."""
from __future__ import annotations

import heapq
import math
from collections import Counter

from envs.base import register
from envs.gym._util import (
    INVALID, MOD, GymEnv, IntAnswer, ListAnswer, ParseError, StrAnswer, balanced, fmt_list, grow_until,
)

F = "strings"


def _n(d, base=6, per_level=20):
    """1.1^d characters up to difficulty 30 (134 for base 6), then ``per_level`` more per level (1534 at 100 for 20;
    1.1^d made 100k-1M character prompts)."""
    return grow_until(base, d, 30, per_level)


def longest_palindrome(s: str) -> str:
    """The longest palindromic substring, the leftmost of those of maximal length, by expanding around each of the
    2n - 1 centres (the first maximum of the substrings scanned by start, then end)."""
    best_len, best_i = 0, 0
    for c in range(2 * len(s) - 1):
        i, j = c // 2, (c + 1) // 2
        while i >= 0 and j < len(s) and s[i] == s[j]:
            i, j = i - 1, j + 1
        n, i = j - i - 1, i + 1
        if n > best_len or (n == best_len and i < best_i):
            best_len, best_i = n, i
    return s[best_i:best_i + best_len]


def _word(rng, n, alpha="abc"):
    return "".join(rng.choice(alpha) for _ in range(n))


def _alpha(d):
    return "abcdefghij"[: 2 + d // 4]


def _symbols(k):
    """``k`` distinct symbol names: a..z, A..Z, then a1..Z1, a2..."""
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return [letters[i % 52] + (str(i // 52) if i >= 52 else "") for i in range(k)]


class _SubstringAnswer(GymEnv):
    """The answer is a substring with a property; graded by validity and (length/optimum)^5."""

    def parse(self, text, problem):
        # the answers are letters: a final period ends the sentence, quotes are how the prompt shows strings
        t = text.strip().removesuffix(".").strip().strip("'\"").removesuffix(".")
        if not t or len(t) > 10_000:
            raise ParseError("expected a non-empty string")
        return t

    def valid(self, problem, s) -> bool:
        raise NotImplementedError

    def grade(self, problem, value):
        if not self.valid(problem, value):
            return INVALID
        return (len(value) / len(problem.answer)) ** 5

    def wrong_answers(self, problem):
        a = problem.answer
        return [a[:-1] if len(a) > 1 else "#", a + "#", "#" + a[1:]]


@register("gym/longest_palindromic_substring")
class LongestPalindromicSubstring(_SubstringAnswer):
    family, description = F, "A longest palindromic substring (any one of maximum length)."

    def build(self, rng, d):
        s = _word(rng, _n(d, 6, 20), _alpha(d))
        best = longest_palindrome(s)
        return f"Give a longest palindromic substring of '{s}'.", best, {"s": s}

    def valid(self, problem, t):
        return t in problem.meta["s"] and t == t[::-1]


@register("gym/longest_common_substring")
class LongestCommonSubstring(_SubstringAnswer):
    family, description = F, "A longest common substring of two strings (any one)."

    def build(self, rng, d):
        while True:  # two short strings may share no letter (seed 1219 at difficulty 0): no answer, drawn again
            out = self._draw(rng, d)
            if out[1]:
                return out

    def _draw(self, rng, d):
        a, b = _word(rng, _n(d, 6, 8), _alpha(d)), _word(rng, _n(d, 6, 8), _alpha(d))
        best, end = 0, 0
        prev = [0] * (len(b) + 1)
        for i in range(1, len(a) + 1):
            cur = [0] * (len(b) + 1)
            for j in range(1, len(b) + 1):
                if a[i - 1] == b[j - 1]:
                    cur[j] = prev[j - 1] + 1
                    if cur[j] > best:
                        best, end = cur[j], i
            prev = cur
        return f"Give a longest common substring of '{a}' and '{b}'.", a[end - best:end], {"a": a, "b": b}

    def valid(self, problem, t):
        return t in problem.meta["a"] and t in problem.meta["b"]


@register("gym/run_length_encoding")
class RunLengthEncoding(StrAnswer):
    family, description = F, "Run-length encode a string."

    def build(self, rng, d):
        s = "".join(rng.choice(_alpha(d + 4)) * rng.randint(1, 3 + d // 2) for _ in range(grow_until(3, d, 30, 3)))
        out, i = [], 0
        while i < len(s):
            j = i
            while j < len(s) and s[j] == s[i]:
                j += 1
            out.append(f"{s[i]}{j - i}")
            i = j
        return (f"Run-length encode '{s}': write each maximal run as the character followed by its length "
                f"(e.g. aaab -> a3b1), with no separators.", "".join(out))

    def parse(self, text, problem):
        return "".join(text.split()).removesuffix(".").strip("'\"").removesuffix(".")


@register("gym/anagram_pairs")
class AnagramPairs(ListAnswer):
    family, description = F, "Decide for several word pairs whether they are anagrams."

    def build(self, rng, d):
        pairs = []
        for _ in range(3 + d // 2):
            w = _word(rng, rng.randint(3, 5 + d), _alpha(d + 4))
            v = list(w)
            rng.shuffle(v)
            if rng.random() < 0.5:
                v[rng.randrange(len(v))] = rng.choice(_alpha(d + 4))
            pairs.append((w, "".join(v)))
        shown = ", ".join(f"({a}, {b})" for a, b in pairs)
        return (f"For each pair {shown}, answer 1 if the two words are anagrams of each other and 0 otherwise, "
                f"separated by spaces.", [int(Counter(a) == Counter(b)) for a, b in pairs])


@register("gym/next_permutation")
class NextPermutation(ListAnswer):
    family, description, partial = F, "The next lexicographic permutation of a sequence.", False

    def build(self, rng, d):
        while True:
            xs = [rng.randint(1, 3 + d) for _ in range(_n(d, 4))]
            i = len(xs) - 2
            while i >= 0 and xs[i] >= xs[i + 1]:
                i -= 1
            if i >= 0:
                break
        j = len(xs) - 1
        while xs[j] <= xs[i]:
            j -= 1
        ys = xs[:]
        ys[i], ys[j] = ys[j], ys[i]
        ys[i + 1:] = reversed(ys[i + 1:])
        return (f"Give the next permutation of the sequence {fmt_list(xs)} in lexicographic order (the smallest "
                f"rearrangement that is strictly greater), separated by spaces.", ys)


@register("gym/min_rotation")
class MinRotation(StrAnswer):
    family, description = F, "Lexicographically smallest rotation of a string (Lyndon/Booth)."

    def build(self, rng, d):
        s = _word(rng, _n(d), _alpha(d))
        return f"What is the lexicographically smallest rotation of '{s}'?", min(s[i:] + s[:i] for i in range(len(s)))


def _balanced(s):
    st, pair = [], {")": "(", "]": "[", "}": "{"}
    for c in s:
        if c in "([{":
            st.append(c)
        elif not st or st.pop() != pair[c]:
            return False
    return not st


@register("gym/bracket_validity")
class BracketValidity(ListAnswer):
    family, description = F, "Which bracket strings are balanced?"

    def build(self, rng, d):
        out = []
        for _ in range(3 + d // 3):
            s, st = [], []
            for _ in range(rng.randint(2, 4 + d)):
                if st and rng.random() < 0.5:
                    s.append({"(": ")", "[": "]", "{": "}"}[st.pop()])
                else:
                    st.append(rng.choice("([{"))
                    s.append(st[-1])
            s += [{"(": ")", "[": "]", "{": "}"}[c] for c in reversed(st)]
            if rng.random() < 0.5:  # a character replaced (counts off), or two swapped (counts kept: "([)]", ")(")
                if rng.random() < 0.3:
                    i = rng.randrange(len(s))
                    s[i] = rng.choice("()[]{}")
                else:
                    i, j = sorted(rng.sample(range(len(s)), 2))
                    s[i], s[j] = s[j], s[i]
            out.append("".join(s))
        return (f"For each of the strings {'  '.join(out)} answer 1 if its brackets are balanced and properly nested, "
                f"else 0, separated by spaces.", [int(_balanced(s)) for s in out])


@register("gym/string_period")
class StringPeriod(IntAnswer):
    family, description = F, "Smallest period of a string (prefix function)."

    def build(self, rng, d):
        # a one-letter base over two letters (period 1: "aaaa") was 54-63% of the problems at difficulties 0-1, with
        # bases of 1-2 letters (now 1-3 at difficulty 0): mostly drawn again
        return balanced(rng, lambda: self._draw(rng, d), lambda ans: ans == 1)

    def _draw(self, rng, d):
        base = _word(rng, rng.randint(1, 3 + d), _alpha(d))
        s = (base * (2 + _n(d, 3) // len(base)))[: rng.randint(len(base) + 1, len(base) * 2 + _n(d, 3))]
        if rng.random() < 0.3:
            s = s[:-1] + rng.choice(_alpha(d))
        pi = [0] * len(s)
        for i in range(1, len(s)):
            k = pi[i - 1]
            while k and s[i] != s[k]:
                k = pi[k - 1]
            pi[i] = k + (s[i] == s[k])
        return (f"What is the smallest positive p such that s[i] = s[i + p] for every valid i, for s = '{s}'?",
                len(s) - pi[-1])


@register("gym/distinct_substrings")
class DistinctSubstrings(IntAnswer):
    family, description = F, "Number of distinct non-empty substrings (suffix automaton)."

    def build(self, rng, d):
        s = _word(rng, _n(d), _alpha(d))
        link, length, nxt, last = [-1], [0], [{}], 0
        for ch in s:
            cur = len(length)
            length.append(length[last] + 1)
            link.append(-1)
            nxt.append({})
            p = last
            while p != -1 and ch not in nxt[p]:
                nxt[p][ch] = cur
                p = link[p]
            if p == -1:
                link[cur] = 0
            else:
                q = nxt[p][ch]
                if length[p] + 1 == length[q]:
                    link[cur] = q
                else:
                    clone = len(length)
                    length.append(length[p] + 1)
                    link.append(link[q])
                    nxt.append(dict(nxt[q]))
                    while p != -1 and nxt[p].get(ch) == q:
                        nxt[p][ch] = clone
                        p = link[p]
                    link[q] = link[cur] = clone
            last = cur
        return (f"How many distinct non-empty substrings does '{s}' have?",
                sum(length[i] - length[link[i]] for i in range(1, len(length))))


@register("gym/pattern_occurrences")
class PatternOccurrences(IntAnswer):
    family, description = F, "Count (possibly overlapping) occurrences of a pattern."

    def build(self, rng, d):
        # 1.15^d characters up to difficulty 30 (722), then 200 per level (14.7k at 100)
        alpha = "ab" if d < 6 else "abc"
        s = _word(rng, grow_until(10, d, 30, 200, 1.15, 2), alpha)
        # a pattern at most as long as one a random string of this length holds about twice (2 + d // 3 letters
        # alone outgrew it: 0 was the answer of 57% of the problems at difficulty 20, 85% at 100)
        longest = max(1, int(math.log(max(2.0, len(s) / 2), len(alpha))))
        p = _word(rng, rng.randint(1, min(2 + d // 3, longest)), alpha)
        return (f"How many times does '{p}' occur in '{s}' (occurrences may overlap)?",
                sum(s.startswith(p, i) for i in range(len(s))))


@register("gym/vigenere_decrypt")
class VigenereDecrypt(StrAnswer):
    family, description, fold_case = F, "Decrypt a Vigenere ciphertext with a known key.", True

    def build(self, rng, d):
        plain = _word(rng, _n(d, 8), "abcdefghijklmnopqrstuvwxyz")
        key = _word(rng, rng.randint(1, 3 + d // 2), "abcdefghijklmnopqrstuvwxyz")
        enc = "".join(chr((ord(c) - 97 + ord(key[i % len(key)]) - 97) % 26 + 97) for i, c in enumerate(plain))
        return (f"The ciphertext '{enc}' was produced by the Vigenere cipher (letter i shifted forward by key letter "
                f"i mod key length, a=0) with key '{key}'. What is the plaintext?", plain)


@register("gym/zigzag_conversion")
class ZigzagConversion(StrAnswer):
    family, description = F, "Read a string written in a zigzag over k rows, row by row."

    def build(self, rng, d):
        s = _word(rng, _n(d, 8), "abcdefghijklmnopqrstuvwxyz")
        k = rng.randint(2, 3 + d // 3)
        rows, r, step = [""] * k, 0, 1
        for c in s:
            rows[r] += c
            if r == 0:
                step = 1
            elif r == k - 1:
                step = -1
            r += step
        return (f"Write '{s}' in a zigzag over {k} rows (down row 0..{k - 1}, then diagonally back up, repeating) and "
                f"read the rows top to bottom. What string results?", "".join(rows))


@register("gym/smallest_subsequence")
class SmallestSubsequence(StrAnswer):
    family, description = F, "Lexicographically smallest subsequence of length k."

    def build(self, rng, d):
        s = _word(rng, _n(d, 7), _alpha(d + 6))
        k = rng.randint(1, len(s) - 1)
        st, drop = [], len(s) - k
        for c in s:
            while drop and st and st[-1] > c:
                st.pop()
                drop -= 1
            st.append(c)
        return f"What is the lexicographically smallest subsequence of length {k} of '{s}'?", "".join(st[:k])


@register("gym/subsequence_count")
class SubsequenceCount(IntAnswer):
    family, description = F, "Number of times t occurs as a subsequence of s."

    def build(self, rng, d):
        s = _word(rng, _n(d, 8), "ab" if d < 4 else "abc")
        t = _word(rng, rng.randint(2, 2 + d // 3), "ab" if d < 4 else "abc")
        ways = [1] + [0] * len(t)
        for c in s:
            for j in range(len(t), 0, -1):
                if t[j - 1] == c:
                    ways[j] += ways[j - 1]
        return (f"In how many ways can '{t}' be obtained as a subsequence of '{s}' (choosing positions)? Give the "
                f"answer modulo 1000000007.", ways[-1] % MOD)


@register("gym/z_function")
class ZFunction(ListAnswer):
    family, description = F, "The Z-array of a string."

    def build(self, rng, d):
        s = _word(rng, _n(d), "ab" if d < 5 else "abc")
        z = [len(s)] + [0] * (len(s) - 1)
        for i in range(1, len(s)):
            while i + z[i] < len(s) and s[z[i]] == s[i + z[i]]:
                z[i] += 1
        return (f"For s = '{s}', give Z[0..{len(s) - 1}] where Z[i] is the length of the longest common prefix of s "
                f"and s[i:] (so Z[0] = {len(s)}), separated by spaces.", z)


@register("gym/huffman_cost")
class HuffmanCost(IntAnswer):
    family, description = F, "Total bits of an optimal prefix (Huffman) code for a text."

    def build(self, rng, d):
        # a count drawn from 2..4 + d/2, at most 4 + d/4: the letters of _alpha(d + 8) were the symbols, and its 10
        # letters stopped the count growing from difficulty 24; the same problems as then up to difficulty 27
        k = min(rng.randint(2, 4 + d // 2), 4 + d // 4)
        freq = {c: rng.randint(1, 10 + 3 * d) for c in _symbols(k)}
        h = list(freq.values())
        heapq.heapify(h)
        cost = 0
        while len(h) > 1:
            a, b = heapq.heappop(h), heapq.heappop(h)
            cost += a + b
            heapq.heappush(h, a + b)
        shown = ", ".join(f"{c}: {f}" for c, f in freq.items())
        return (f"A text has character frequencies {shown}. What is the minimum total number of bits needed to encode "
                f"it with a binary prefix code (Huffman coding)?", cost)


@register("gym/min_insertions_balance")
class MinInsertionsBalance(IntAnswer):
    family, description = F, "Minimum insertions that balance a parenthesis string."

    def build(self, rng, d):
        s = _word(rng, _n(d), "()")
        open_, need = 0, 0
        for c in s:
            if c == "(":
                open_ += 1
            elif open_:
                open_ -= 1
            else:
                need += 1
        return f"What is the minimum number of '(' or ')' insertions that make '{s}' a balanced parenthesis string?", need + open_
