"""The verifiers of Cascade's own environments (envs/gym) on hand-built problems: wrong answers that must not be
credited and right answers (in forms the prompts allow) that must not be refused. Each expected value is worked out by hand in the comments."""
from __future__ import annotations

from fractions import Fraction

import pytest

from envs.base import Problem, get_env
from envs.gym._util import INVALID, ParseError, grow_until, parse_fraction, parse_int, parse_path


def boxed(s) -> str:
    return f"<think>working</think> The answer is \\boxed{{{s}}}."


def problem(env_id, answer, **meta) -> Problem:
    return Problem("(hand-built problem)", answer, env_id, 0, 0, meta)


def reward(env_id, p, text) -> float:
    return get_env(env_id).verify(p, boxed(text)).reward


# --- parsers -----------------------------------------------------------------------------------
def test_thousands_separators_need_groups_of_three_digits():
    assert parse_int("1,234,567") == 1234567
    for bad in ("1,23", "12,3456", "1,2,3"):
        with pytest.raises(ParseError):
            parse_int(bad)
    p = get_env("gym/crt").generate(0, 2)
    assert p.answer >= 100
    a = str(p.answer)
    assert get_env("gym/crt").verify(p, boxed(a[:-2] + "," + a[-2:])).reward == -1.0  # "15,69" is not 1569


def test_paths_refuse_negative_vertices():
    assert parse_path("0 -> 3 -> 2") == [0, 3, 2]
    assert parse_path("0->3->2") == parse_path("0 \\to 3 \\to 2") == parse_path("0-3-2") == [0, 3, 2]
    for bad in ("-1 2 3", "0, -3", "[0, 3, -2]", "0 -> -3 -> 2", "0 \\to -3", "0 \u2192 -3"):  # (an arrow's dash is none)
        with pytest.raises(ParseError):
            parse_path(bad)


def test_mixed_numbers_and_decimals():
    assert parse_fraction("2 3/4") == Fraction(11, 4)
    assert parse_fraction("-2 3/4") == Fraction(-11, 4)  # minus applies to the whole mixed number (not -2 + 3/4)
    assert parse_fraction("0.25") == Fraction(1, 4) and parse_fraction("-1.5") == Fraction(-3, 2)
    for bad in ("1 3/3", "1 4/3", "1 0/3"):  # a mixed number's fraction part is proper and non-zero
        with pytest.raises(ParseError):
            parse_fraction(bad)


def test_division_by_zero_in_a_fraction_is_a_format_error():
    p = problem("gym/polygon_area", "5/2")
    s = get_env("gym/polygon_area").verify(p, boxed("1/0"))
    assert (s.reward, s.correct, s.format_ok) == (-1.0, False, False)
    assert reward("gym/polygon_area", p, "\\tfrac{5}{2}") == 1.0 and reward("gym/polygon_area", p, "2.5") == 1.0
    assert reward("gym/polygon_area", p, "-2.5") == 0.0


def test_size_past_the_knee_grows_by_per_level():
    # grow(3, 30, 1.1, 1) = int(3 * 1.1**30 + 30) = int(52.35 + 30) = 82; then 4 more per level
    assert grow_until(3, 30, 30, 4) == 82
    assert grow_until(3, 31, 30, 4) == 86 and grow_until(3, 35, 30, 4) == 102
    assert grow_until(3, 29, 30, 4) == int(3 * 1.1 ** 29 + 29)


# --- list / string answers ---------------------------------------------------------------------
def test_list_answers_partial_credit_and_wrong_length():
    p = problem("gym/sort_numbers", [1, 2, 3, 4])
    assert reward("gym/sort_numbers", p, "1 2 4 3") == pytest.approx(0.5 ** 10)
    assert reward("gym/sort_numbers", p, "1 2 3") == INVALID and reward("gym/sort_numbers", p, "1 2 3 4 5") == INVALID


def test_quoted_string_answers_keep_quotes_that_belong_to_the_answer():
    env = get_env("gym/min_rotation")
    p = problem("gym/min_rotation", "abc")
    assert env.verify(p, boxed("'abc'")).correct and env.verify(p, boxed('"abc"')).correct
    q = problem("gym/min_rotation", "'ab'")  # a reference that itself starts with a quote is compared as written
    assert env.verify(q, boxed("'ab'")).correct
    assert not env.verify(q, boxed("ab")).correct


def test_case_folded_string_answers():
    env = get_env("gym/graphical_sequence")
    p = problem("gym/graphical_sequence", "YES")
    for text in ("yes", "Yes", "YES."):
        assert env.verify(p, boxed(text)).correct, text
    assert env.verify(p, boxed("no")).reward == 0.0


def test_token_answers_are_case_insensitive_with_partial_credit():
    p = problem("gym/point_in_polygon", ["I", "O", "B", "O"])
    assert reward("gym/point_in_polygon", p, "i o b o") == 1.0
    assert reward("gym/point_in_polygon", p, "I O B I") == pytest.approx(0.75 ** 10)


# --- graphs ------------------------------------------------------------------------------------
def test_shortest_path_longer_path_partial_credit():
    # triangle 0-1 (1), 1-2 (1), 0-2 (3): shortest 0 1 2 (2); the direct edge weighs 3 -> (2/3)^5
    p = problem("gym/shortest_path", [0, 1, 2], n=3, edges=[[0, 1, 1], [1, 2, 1], [0, 2, 3]], dist=2)
    assert reward("gym/shortest_path", p, "0 1 2") == 1.0
    assert reward("gym/shortest_path", p, "0 2") == pytest.approx((2 / 3) ** 5)


def test_mst_edges_must_form_a_tree():
    # square 0-1-2-3 with weights 1, 1, 1, 5 and chord 0-2 weight 9: the MST is 0-1, 1-2, 2-3 (3)
    edges = [[0, 1, 1], [1, 2, 1], [2, 3, 1], [3, 0, 5], [0, 2, 9]]
    p = problem("gym/mst_edges", [[0, 1], [1, 2], [2, 3]], n=4, edges=edges, w=3)
    assert reward("gym/mst_edges", p, "1 0, 2 1, 3 2") == 1.0
    assert reward("gym/mst_edges", p, "0 1, 1 2, 0 1") == INVALID  # a repeated edge (weight 3) spans nothing
    assert reward("gym/mst_edges", p, "0 1, 1 2, 2 3, 3 0") == INVALID


def test_graph_colouring_colours_in_range_and_partial_credit():
    # path 0-1-2-3, k = 3
    p = problem("gym/graph_coloring", [0, 1, 0, 1], k=3, edges=[[0, 1], [1, 2], [2, 3]])
    assert reward("gym/graph_coloring", p, "2 1 0 1") == 1.0
    assert reward("gym/graph_coloring", p, "3 1 0 1") == INVALID  # colours are 0..k-1
    assert reward("gym/graph_coloring", p, "0 0 1 0") == pytest.approx((2 / 3) ** 10)  # 0-1 clashes


def test_bipartite_check_two_colours_only_and_no_in_any_case():
    # triangle-free path 0-1-2: bipartite
    p = problem("gym/bipartite_check", [0, 1, 0], n=3, edges=[[0, 1], [1, 2]])
    assert reward("gym/bipartite_check", p, "1 0 1") == 1.0
    assert reward("gym/bipartite_check", p, "0 1 2") == INVALID  # a proper 3-colouring is not a 2-colouring
    q = problem("gym/bipartite_check", "NO", n=3, edges=[[0, 1], [1, 2], [0, 2]])
    for text in ("NO", "no", "No."):
        assert reward("gym/bipartite_check", q, text) == 1.0, text


def test_bridges_in_either_orientation_and_none():
    p = problem("gym/bridges", [[1, 3], [2, 3]])
    assert reward("gym/bridges", p, "3 1, 3 2") == 1.0
    assert reward("gym/bridges", p, "(2, 3), (1, 3)") == 1.0
    assert reward("gym/bridges", p, "1 3") == 0.0
    q = problem("gym/bridges", [])
    for text in ("none", "None", "empty", "\\emptyset"):
        assert reward("gym/bridges", q, text) == 1.0, text
    assert reward("gym/bridges", q, "0 1") == 0.0


def test_euler_path_uses_only_graph_edges():
    # edges 0-1, 1-2, 2-0, 2-3: 3 2 0 1 2 is an Euler trail; 0 1 2 3 0 has 4 steps (as many as edges) but 3-0
    # is not an edge and 2-0 is missing
    p = problem("gym/euler_path", [3, 2, 0, 1, 2], edges=[[0, 1], [1, 2], [0, 2], [2, 3]])
    assert reward("gym/euler_path", p, "3 2 0 1 2") == 1.0
    assert reward("gym/euler_path", p, "2 1 0 2 3") == 1.0
    assert reward("gym/euler_path", p, "0 1 2 3 0") == INVALID
    assert reward("gym/euler_path", p, "3 2 1 0 1") == 0.0  # 0-1 twice, 0-2 never: a graph edge repeated


def test_bipartite_matching_each_vertex_once():
    # L0-R0, L0-R1, L1-R0: max matching 2 ({L0-R1, L1-R0})
    p = problem("gym/bipartite_matching", [[0, 1], [1, 0]], edges=[[0, 0], [0, 1], [1, 0]])
    assert reward("gym/bipartite_matching", p, "L1-R0, L0-R1") == 1.0
    assert reward("gym/bipartite_matching", p, "0 0, 0 1") == INVALID  # L0 twice
    assert reward("gym/bipartite_matching", p, "0 0, 1 0") == INVALID  # R0 twice
    assert reward("gym/bipartite_matching", p, "0 0") == pytest.approx(0.5 ** 5)


def test_topological_order_is_a_permutation():
    p = problem("gym/topological_order", [0, 1, 2], edges=[[0, 1], [1, 2]])
    assert reward("gym/topological_order", p, "0 1 2") == 1.0
    assert reward("gym/topological_order", p, "0 1 2 2") == INVALID
    assert reward("gym/topological_order", p, "0 2 1") == 0.0


# --- logic puzzles -----------------------------------------------------------------------------
def test_grid_puzzles_respect_the_givens():
    # both 3x3 Latin squares below are valid; only the first agrees with the givens
    givens = [[1, 0, 0], [0, 0, 0], [0, 0, 0]]
    p = problem("gym/latin_square", [[1, 2, 3], [2, 3, 1], [3, 1, 2]], givens=givens)
    assert reward("gym/latin_square", p, "1 3 2; 3 2 1; 2 1 3") == 1.0  # another completion of the givens
    assert reward("gym/latin_square", p, "2 3 1; 3 1 2; 1 2 3") == 0.0  # valid square, given 1 overwritten


def test_latin_square_columns_are_checked():
    p = problem("gym/latin_square", [[1, 2, 3], [2, 3, 1], [3, 1, 2]], givens=[[0] * 3 for _ in range(3)])
    assert reward("gym/latin_square", p, "1 2 3; 1 2 3; 1 2 3") == 0.0  # rows fine, columns repeat


def test_magic_square_needs_diagonals_and_each_number_once():
    ref = [[2, 7, 6], [9, 5, 1], [4, 3, 8]]
    p = problem("gym/magic_square", ref, givens=[[0] * 3 for _ in range(3)])
    assert reward("gym/magic_square", p, "2 7 6; 9 5 1; 4 3 8") == 1.0
    assert reward("gym/magic_square", p, "8 1 6; 3 5 7; 4 9 2") == 1.0  # another magic square
    # rows of the magic square permuted: rows and columns still sum to 15, the diagonals (9+7+8, 1+7+4) do not
    assert reward("gym/magic_square", p, "9 5 1; 2 7 6; 4 3 8") == 0.0
    assert reward("gym/magic_square", p, "5 5 5; 5 5 5; 5 5 5") == 0.0  # every line 15, but not 1..9


def test_n_queens_keeps_the_pre_placed_queens():
    # 4x4: the two solutions are 2 4 1 3 and 3 1 4 2; row 1's queen is pre-placed in column 2
    p = problem("gym/n_queens", [2, 4, 1, 3], fixed={"0": 2})
    assert reward("gym/n_queens", p, "2 4 1 3") == 1.0
    assert reward("gym/n_queens", p, "3 1 4 2") == 0.0


def test_sat_named_assignment_must_name_every_variable():
    # (x1 OR x2 OR NOT x3): x1=1 alone leaves x2, x3 unset
    p = problem("gym/sat_assignment", [1, 0, 0], clauses=[[1, 2, -3]])
    assert reward("gym/sat_assignment", p, "x1=1, x2=0, x3=0") == 1.0
    assert reward("gym/sat_assignment", p, "x1=1") == INVALID
    assert reward("gym/sat_assignment", p, "x1=1, x2=0, x3=0, x3=1") == -1.0  # x3 given two values


def test_cryptarithm_digits_distinct_and_no_leading_zero():
    # A + B = C: 1 + 2 = 3; A=1, B=1, C=2 sums right but gives two letters one digit
    p = problem("gym/cryptarithm", {"A": 1, "B": 2, "C": 3}, words=["A", "B"], total="C")
    assert reward("gym/cryptarithm", p, "A=3, B=4, C=7") == 1.0
    assert reward("gym/cryptarithm", p, "a=2, b=5, c=7") == 1.0
    assert reward("gym/cryptarithm", p, "A=1, B=1, C=2") == INVALID
    # AB + B = AC: 12 + 2 = 14; with A=0, 02 + 2 = 04 sums right but two numbers start with 0
    q = problem("gym/cryptarithm", {"A": 1, "B": 2, "C": 4}, words=["AB", "B"], total="AC")
    assert reward("gym/cryptarithm", q, "A=1, B=2, C=4") == 1.0
    assert reward("gym/cryptarithm", q, "A=0, B=2, C=4") == 0.0


def test_hanoi_legality_and_optimality():
    # disks 2 (bottom) and 1 on peg 1, to peg 3: optimal 1 2, 1 3, 2 3
    p = problem("gym/tower_of_hanoi", [[1, 2], [1, 3], [2, 3]], n=2, start=[1, 1], dst=3)
    assert reward("gym/tower_of_hanoi", p, "1 2, 1 3, 2 3") == 1.0
    assert reward("gym/tower_of_hanoi", p, "1 -> 2, 1 -> 3, 2 -> 3") == 1.0
    assert reward("gym/tower_of_hanoi", p, "1 2, 1 2, 2 3") == INVALID  # disk 2 onto disk 1
    # legal but 5 moves instead of 3: (3/5)^5
    assert reward("gym/tower_of_hanoi", p, "1 3, 3 2, 1 3, 2 1, 1 3") == pytest.approx((3 / 5) ** 5)
    assert reward("gym/tower_of_hanoi", p, "1 2, 1 3") == 0.0  # disk 1 left on peg 2


def test_sliding_puzzle_moves_stay_on_the_board():
    # 1 2 3 / 4 5 6 / 7 0 8: R solves it; L from column 0 must not wrap to the row above
    p = problem("gym/sliding_puzzle", "R", board=[1, 2, 3, 4, 5, 6, 7, 0, 8], k=3)
    assert reward("gym/sliding_puzzle", p, "R") == 1.0
    assert reward("gym/sliding_puzzle", p, "LLRRR") == INVALID  # the second L leaves the board
    q = problem("gym/sliding_puzzle", "L", board=[1, 2, 3, 0, 4, 5, 6, 7, 8], k=3)
    # blank at row 1 col 0; "L" would wrap to index 2 (row 0 col 2): refused
    assert reward("gym/sliding_puzzle", q, "L") == INVALID


def test_mastermind_colours_in_range():
    # code length 2, colours 1..2; one guess "1 1" -> 1 exact, 0 misplaced (code 1 2 or 2 1)
    p = problem("gym/mastermind", [1, 2], guesses=[[1, 1]], k=2)
    assert reward("gym/mastermind", p, "2 1") == 1.0
    assert reward("gym/mastermind", p, "1 3") == INVALID  # 3 is no colour (and would be consistent)


def test_countdown_each_number_exactly_once():
    p = problem("gym/countdown", "2 + 3", nums=[2, 3], target=5)
    assert reward("gym/countdown", p, "3 + 2") == 1.0
    assert reward("gym/countdown", p, "3 + 2 = 5") == 1.0
    assert reward("gym/countdown", p, "3 + 2 = 6") == -1.0
    q = problem("gym/countdown", "2 * 3 - 2", nums=[2, 2, 3], target=4)
    assert reward("gym/countdown", q, "2 * 2") == INVALID  # 3 unused
    assert reward("gym/countdown", q, "3 * 2 - 2") == 1.0
    r = problem("gym/countdown", "2 + 2", nums=[2, 2], target=4)
    assert reward("gym/countdown", r, "2 * 2 * 2 / 2") == INVALID  # 2 used four times


# --- dynamic programming, number theory, sorting -----------------------------------------------
def test_lis_strictly_increasing_and_in_order():
    p = problem("gym/longest_increasing_subsequence", [3, 5, 15], xs=[3, 3, 5, 15, 3, 0])
    assert reward("gym/longest_increasing_subsequence", p, "3 5 15") == 1.0
    assert reward("gym/longest_increasing_subsequence", p, "3 3 5 15") == INVALID  # not strictly increasing
    q = problem("gym/longest_increasing_subsequence", [1, 2], xs=[5, 1, 2, 0])
    assert reward("gym/longest_increasing_subsequence", q, "0 5") == INVALID  # values present, order not
    assert reward("gym/longest_increasing_subsequence", q, "1") == pytest.approx(0.5 ** 5)


def test_subset_sum_indices_used_once():
    # 4 + 4 would need index 0 twice
    p = problem("gym/subset_sum", [1, 2], xs=[4, 3, 5], t=8)
    assert reward("gym/subset_sum", p, "1 2") == 1.0
    assert reward("gym/subset_sum", p, "0 0") == INVALID
    assert reward("gym/subset_sum", p, "0 3") == INVALID


def test_continued_fraction_terms_after_the_first_are_positive():
    # 14/3 = 4 + 1/(1 + 1/2): [4; 1, 2] and the other expansion [4; 1, 1, 1]
    p = problem("gym/continued_fraction", [4, 1, 2], value="14/3")
    assert reward("gym/continued_fraction", p, "4 1 2") == 1.0
    assert reward("gym/continued_fraction", p, "4 1 1 1") == 1.0
    # [4; 0, 1, 2] = 4 + 1/(0 + 1/(1 + 1/2)) = 4 + 3/2 ... not 14/3 anyway; [2; 0, 2, 1, 2] = 2 + 2 + 2/3 = 14/3
    assert reward("gym/continued_fraction", p, "2 0 2 1 2") == INVALID


def test_prime_factorization_braced_exponents_and_non_primes():
    p = problem("gym/prime_factorization", [2, 2, 2, 3])
    assert reward("gym/prime_factorization", p, "2^{3} * 3") == 1.0
    assert reward("gym/prime_factorization", p, "2^3 \\times 3") == 1.0
    assert reward("gym/prime_factorization", p, "4 * 2 * 3") == 0.0
    assert reward("gym/prime_factorization", p, "1 * 2^3 * 3") == 0.0


def test_merge_intervals_endpoints_in_order():
    p = problem("gym/merge_intervals", [[1, 4], [6, 9]])
    assert reward("gym/merge_intervals", p, "[1, 4], [6, 9]") == 1.0
    assert reward("gym/merge_intervals", p, "[4, 1], [9, 6]") == 0.0


# --- strings, geometry, and "correct" meaning full credit ---------------------------------------
def test_substring_answers_valid_and_length_credit():
    p = problem("gym/longest_palindromic_substring", "abcba", s="xabcbay")
    assert reward("gym/longest_palindromic_substring", p, "'abcba'") == 1.0
    assert reward("gym/longest_palindromic_substring", p, "bcb") == pytest.approx((3 / 5) ** 5)
    assert reward("gym/longest_palindromic_substring", p, "xabc") == INVALID  # a substring, not a palindrome
    assert reward("gym/longest_palindromic_substring", p, "aba") == INVALID  # a palindrome, not a substring
    q = problem("gym/longest_common_substring", "bcd", a="abcde", b="xbcdy")
    assert reward("gym/longest_common_substring", q, '"bcd"') == 1.0
    assert reward("gym/longest_common_substring", q, "abcd") == INVALID  # in a only
    assert reward("gym/longest_common_substring", q, "cdy") == INVALID  # in b only


def test_convex_hull_any_starting_vertex_counter_clockwise():
    sq = [[0, 0], [2, 0], [2, 2], [0, 2]]
    p = problem("gym/convex_hull", sq)
    assert reward("gym/convex_hull", p, "(0, 0), (2, 0), (2, 2), (0, 2)") == 1.0
    assert reward("gym/convex_hull", p, "(2, 2), (0, 2), (0, 0), (2, 0)") == 1.0
    assert reward("gym/convex_hull", p, "(0, 0), (0, 2), (2, 2), (2, 0)") == 0.0  # clockwise
    assert reward("gym/convex_hull", p, "(0, 0), (2, 0), (2, 2), (1, 2)") == 0.0  # a wrong vertex
    assert reward("gym/convex_hull", p, "(0, 0), (2, 0), (2, 2)") == 0.0


def test_articulation_points_in_any_order():
    p = problem("gym/articulation_points", [1, 3])
    assert reward("gym/articulation_points", p, "3 1") == 1.0
    assert reward("gym/articulation_points", p, "1") == 0.0


def test_sqrt_mod_both_roots_only():
    # x^2 = 4 (mod 7): x = 2, 5
    p = problem("gym/sqrt_mod", [2, 5], p=7, a=4)
    assert reward("gym/sqrt_mod", p, "5, 2") == 1.0
    assert reward("gym/sqrt_mod", p, "0 2") == 0.0
    assert reward("gym/sqrt_mod", p, "2 7") == INVALID  # 7 is outside [0, 6]


def test_nearly_optimal_is_not_correct():
    # shortest 0 -> 2 is 0 1 2 (10000); the direct edge weighs 10001: reward (10000/10001)^5 > 0.999, not correct
    p = problem("gym/shortest_path", [0, 1, 2], n=3, edges=[[0, 1, 5000], [1, 2, 5000], [0, 2, 10001]], dist=10000)
    s = get_env("gym/shortest_path").verify(p, boxed("0 2"))
    assert s.reward == pytest.approx((10000 / 10001) ** 5) and s.reward > 0.999
    assert not s.correct and s.format_ok


def test_overlong_answers_are_refused_before_parsing():
    p = problem("gym/sort_numbers", [1, 2, 3])
    s = get_env("gym/sort_numbers").verify(p, boxed("1 " * 60_000))  # 120k characters (the limit is 100k)
    assert (s.reward, s.format_ok) == (-1.0, False) and "too long" in s.info["reason"]


# --- difficulty scaling (sizes stated in the prompts and the generators' comments) -------------
def test_grow_formula():
    from envs.gym._util import grow
    assert grow(3, 0) == 3 and grow(3, 10) == 17  # int(3 * 1.1**10 + 10) = int(7.78 + 10)
    assert grow(6, 30, 1.15, 2) == 457  # "1.15^d steps to difficulty 30 (457)" (euler_path)


def test_puzzle_sizes_at_given_levels():
    import re

    def board(env_id, d, pat):
        return int(re.search(pat, get_env(env_id).generate(0, d).prompt)[1])

    # n queens: an (4 + d) board
    assert [board("gym/n_queens", d, r"Place (\d+) queens") for d in (0, 5, 12)] == [4, 9, 16]
    # Latin square: 3 + d // 2 (172 x 172 at the cap, difficulty 339)
    assert [board("gym/latin_square", d, r"Complete this (\d+)x") for d in (0, 4, 9)] == [3, 5, 7]
    # graph colouring: colours 0..k-1 with k = 3 + d // 8
    assert [board("gym/graph_coloring", d, r"colours 0\.\.(\d+)") + 1 for d in (0, 8, 16)] == [3, 4, 5]
    # sliding puzzle: a (3 + d // 8) board, scrambled by 3 + 2 d moves (the reference undoes them)
    assert [board("gym/sliding_puzzle", d, r"A (\d+)x") for d in (0, 8, 16)] == [3, 4, 5]
    assert [len(get_env("gym/sliding_puzzle").generate(0, d).answer) for d in (0, 3, 10)] == [3, 9, 23]
    # prime factorisation: 2 + d // 2 prime factors
    assert [len(get_env("gym/prime_factorization").generate(0, d).answer) for d in (0, 3, 10)] == [2, 3, 7]
    # knights and knaves: 2 + d // 3 people up to difficulty 30 (12), then one per 8 levels (20 at 94)
    kk = get_env("gym/knights_knaves")
    assert [len(kk.generate(0, d).answer) for d in (0, 9, 30, 38, 94)] == [2, 5, 12, 13, 20]


def test_a_fraction_with_a_signed_denominator_or_a_decimal_numerator_is_its_value():
    """The parser's pattern took "1/-2" and "-1.5/3", then Fraction() of the whole string refused them: a right
    value scored -1 as a format error."""
    p = problem("gym/fraction_sum", "-1/2")
    for text in ("-1/2", "1/-2", "\\frac{1}{-2}", "-0.5", "-1.5/3", "0.5/-1"):
        assert reward("gym/fraction_sum", p, text) == 1.0, text
    for text in ("1/2", "-1/-2", "1/0"):
        assert reward("gym/fraction_sum", p, text) <= 0, text
