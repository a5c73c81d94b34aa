"""Computational geometry on integer points (exact arithmetic throughout)."""
from __future__ import annotations

import itertools
import math
from fractions import Fraction

from envs.base import register
from envs.gym._util import (
    INVALID, FracAnswer, GymEnv, IntAnswer, ListAnswer, ParseError, balanced, frac_str, grow_until,
    parse_groups, parse_tokens,
)

F = "geometry"


def _pts(rng, n, r):
    return [(rng.randint(-r, r), rng.randint(-r, r)) for _ in range(n)]


def _show(pts):
    return ", ".join(f"({x}, {y})" for x, y in pts)


def cross(o, a, b):
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def twice_area(poly):
    return sum(x1 * y2 - x2 * y1 for (x1, y1), (x2, y2) in zip(poly, poly[1:] + poly[:1]))


def star_polygon(rng, n, r, tries: int = 30):
    """A simple polygon: distinct integer points sorted by angle around an interior centre.

    A draw is kept as it is when no two points share an angle around the centre and no three consecutive points are
    collinear; past ``tries`` draws the offending points are dropped from the draw instead (with hundreds of points
    some always offend: the draws alone never ended past difficulty ~45)."""
    for attempt in itertools.count():
        pts = list(set(_pts(rng, n, r)))
        if len(pts) < 3:
            continue
        cx, cy = Fraction(sum(p[0] for p in pts), len(pts)), Fraction(sum(p[1] for p in pts), len(pts))
        key = lambda p: (math.atan2(p[1] - cy, p[0] - cx))  # noqa: E731
        pts.sort(key=key)
        angles = [key(p) for p in pts]
        if len(set(angles)) == len(angles) and twice_area(pts) != 0 and \
                all(cross(pts[i - 1], pts[i], pts[(i + 1) % len(pts)]) != 0 for i in range(len(pts))):
            if all(cross((cx, cy), pts[i], pts[(i + 1) % len(pts)]) > 0 for i in range(len(pts))):
                return pts
        if attempt >= tries:
            poly = _star_subset(pts, (cx, cy))
            if poly:
                return poly


def _star_subset(pts, centre):
    """``pts`` (sorted by angle around ``centre``) less the points that share an angle with the point before or lie
    on the line through their neighbours: every turn about the centre strictly positive (an angle below pi, so the
    polygon is star-shaped about the centre, hence simple) and every vertex a corner; None if more than a tenth of
    the points would go (a gap of pi or more around the centre: another draw)."""
    pts, budget = list(pts), len(pts) // 10
    while len(pts) >= 3:
        k = len(pts)
        bad = next((i for i in range(k) if cross(centre, pts[i - 1], pts[i]) <= 0
                    or cross(pts[i - 1], pts[i], pts[(i + 1) % k]) == 0), None)
        if bad is None:
            return pts
        if budget == 0:
            return None
        del pts[bad]
        budget -= 1
    return None


@register("gym/polygon_area")
class PolygonArea(FracAnswer):
    family, description = F, "Area of a simple polygon (shoelace formula)."

    def build(self, rng, d):
        # exponential up to difficulty 30 (99 vertices), then 3 vertices per level (309 at 100)
        poly = star_polygon(rng, grow_until(4, d, 30, 3), 5 + 2 * d)
        return (f"The vertices of a simple polygon in order are {_show(poly)}. What is its area? Give an exact value "
                f"(an integer, a fraction p/q or a decimal).", frac_str(Fraction(abs(twice_area(poly)), 2)))


def convex_hull(pts):
    pts = sorted(set(pts))
    if len(pts) < 3:
        return pts
    lo, hi = [], []
    for p in pts:
        while len(lo) >= 2 and cross(lo[-2], lo[-1], p) <= 0:
            lo.pop()
        lo.append(p)
    for p in reversed(pts):
        while len(hi) >= 2 and cross(hi[-2], hi[-1], p) <= 0:
            hi.pop()
        hi.append(p)
    return lo[:-1] + hi[:-1]


@register("gym/convex_hull")
class ConvexHull(GymEnv):
    family, description = F, "Vertices of the convex hull in counter-clockwise order (any starting vertex)."

    def build(self, rng, d):
        pts = list(set(_pts(rng, grow_until(6, d, 30, 12), 6 + 2 * d)))  # 134 points at 30, then 12 per level
        rng.shuffle(pts)
        hull = convex_hull(pts)
        return (f"Points: {_show(pts)}. Give the vertices of their convex hull (corners only, no points in the middle "
                f"of an edge) in counter-clockwise order, as '(x, y)' pairs separated by commas.", [list(p) for p in hull])

    def format_answer(self, answer):
        return _show(answer)

    def parse(self, text, problem):
        return [tuple(p) for p in parse_groups(text, 2, signed=True)]

    def grade(self, problem, value):
        ref = [tuple(p) for p in problem.answer]
        if len(value) != len(ref) or set(value) != set(ref):
            return 0.0 if value else INVALID
        k = ref.index(value[0])
        return 1.0 if ref[k:] + ref[:k] == value else 0.0

    def wrong_answers(self, problem):
        a = problem.answer
        return [_show(a[::-1]), _show(a[:-1]), _show(a + [[10 ** 6, 10 ** 6]])]


def _on_segment(p, a, b):
    return cross(a, b, p) == 0 and min(a[0], b[0]) <= p[0] <= max(a[0], b[0]) and min(a[1], b[1]) <= p[1] <= max(a[1], b[1])


def point_in_polygon(p, poly):
    inside = False
    for a, b in zip(poly, poly[1:] + poly[:1]):
        if _on_segment(p, a, b):
            return "B"
        if (a[1] > p[1]) != (b[1] > p[1]):
            # x coordinate of the crossing compared exactly
            if (p[0] - a[0]) * (b[1] - a[1]) < (b[0] - a[0]) * (p[1] - a[1]) if b[1] > a[1] else \
                    (p[0] - a[0]) * (b[1] - a[1]) > (b[0] - a[0]) * (p[1] - a[1]):
                inside = not inside
    return "I" if inside else "O"


class _TokenList(GymEnv):
    """Answer is a list of tokens from ``vocab``; partial credit (fraction correct)^10."""

    vocab: tuple = ()

    def format_answer(self, answer):
        return " ".join(answer)

    def parse(self, text, problem):
        toks = [t.upper() for t in parse_tokens(text)]
        if any(t not in self.vocab for t in toks):
            raise ParseError(f"tokens must be among {', '.join(self.vocab)}")
        return toks

    def grade(self, problem, value):
        if len(value) != len(problem.answer):
            return INVALID
        return (sum(a == b for a, b in zip(value, problem.answer)) / len(value)) ** 10

    def wrong_answers(self, problem):
        a = problem.answer
        other = [next(v for v in self.vocab if v != x) for x in a]
        return [" ".join(a[:-1] + other[-1:]), " ".join(a[:-1]) or other[0] + " " + other[0], " ".join(other)]


@register("gym/point_in_polygon")
class PointInPolygon(_TokenList):
    family, description, vocab = F, "Classify points as inside, outside or on the boundary of a polygon.", ("I", "O", "B")

    def build(self, rng, d):
        r = 5 + 2 * d
        poly = star_polygon(rng, grow_until(4, d, 30, 3), r)  # as polygon_area's
        qs = _pts(rng, 3 + d // 2, r)
        slots = list(range(len(qs)))
        rng.shuffle(slots)
        if rng.random() < 0.8:  # a point on a random edge (a vertex, or a lattice point between two): it was poly[0]
            k = rng.randrange(len(poly))
            (x1, y1), (x2, y2) = poly[k], poly[(k + 1) % len(poly)]
            g = math.gcd(abs(x2 - x1), abs(y2 - y1))
            t = rng.randrange(g)
            qs[slots[0]] = (x1 + t * (x2 - x1) // g, y1 + t * (y2 - y1) // g)
        if rng.random() < 0.6:  # and one inside (small polygons have few: "B at a vertex, else O" answered half)
            xs, ys = [x for x, _ in poly], [y for _, y in poly]
            inside = [q for q in ((rng.randint(min(xs), max(xs)), rng.randint(min(ys), max(ys))) for _ in range(50))
                      if point_in_polygon(q, poly) == "I"]
            if inside:
                qs[slots[1]] = inside[0]
        return (f"A simple polygon has vertices {_show(poly)} in order. For each point {_show(qs)} answer I (strictly "
                f"inside), O (outside) or B (on the boundary), separated by spaces.",
                [point_in_polygon(q, poly) for q in qs])


@register("gym/pick_interior_points")
class PickInteriorPoints(IntAnswer):
    family, description = F, "Lattice points strictly inside a lattice polygon (Pick's theorem)."

    def build(self, rng, d):
        poly = star_polygon(rng, grow_until(3, d, 30, 2, 1.1, 0.5), 4 + 3 * d)  # 67 vertices at 30, 207 at 100
        a2 = abs(twice_area(poly))
        b = sum(math.gcd(abs(x2 - x1), abs(y2 - y1)) for (x1, y1), (x2, y2) in zip(poly, poly[1:] + poly[:1]))
        return (f"How many lattice points lie strictly inside the polygon with vertices {_show(poly)} (in order)?",
                (a2 - b + 2) // 2)


@register("gym/triangle_classify")
class TriangleClassify(_TokenList):
    family, description = F, "Classify triangles as acute, right, obtuse or degenerate."
    vocab = ("ACUTE", "RIGHT", "OBTUSE", "DEGENERATE")

    def build(self, rng, d):
        tris, labels = [], []
        r = 4 + 2 * d
        for _ in range(2 + d // 2):
            kind = rng.randrange(4)
            a = (rng.randint(-r, r), rng.randint(-r, r))
            u = (rng.randint(1, r), rng.randint(-r, r))
            if kind == 0:  # right angle at a
                k = rng.randint(1, 3)
                tri = [a, (a[0] + u[0], a[1] + u[1]), (a[0] - k * u[1], a[1] + k * u[0])]
            elif kind == 1:  # collinear
                k = rng.randint(2, 4)
                tri = [a, (a[0] + u[0], a[1] + u[1]), (a[0] + k * u[0], a[1] + k * u[1])]
            else:
                tri = _pts(rng, 3, r)
            rng.shuffle(tri)
            sq = sorted((p[0] - q[0]) ** 2 + (p[1] - q[1]) ** 2 for p, q in ((tri[0], tri[1]), (tri[1], tri[2]), (tri[0], tri[2])))
            if cross(*tri) == 0:
                lab = "DEGENERATE"
            else:
                lab = "RIGHT" if sq[0] + sq[1] == sq[2] else "ACUTE" if sq[0] + sq[1] > sq[2] else "OBTUSE"
            tris.append(tri)
            labels.append(lab)
        shown = "; ".join(_show(t) for t in tris)
        return (f"Classify each triangle (given by its three vertices) as ACUTE, RIGHT, OBTUSE or DEGENERATE (collinear "
                f"or repeated points): {shown}. Answer the labels separated by spaces.", labels)


def closest_pair_sq(pts) -> int:
    """Smallest squared distance between two of the points (at least two): a sweep in x that stops comparing once
    the x gap alone is at least the best so far (exact, the O(n^2) scan's answer)."""
    pts = sorted(pts)
    best = None
    for i, (x, y) in enumerate(pts):
        for u, v in pts[i + 1:]:
            dx = u - x
            if best is not None and dx * dx >= best:
                break
            q = dx * dx + (v - y) ** 2
            if best is None or q < best:
                best = q
    return best


@register("gym/closest_pair")
class ClosestPair(IntAnswer):
    family, description = F, "Squared distance of the closest pair of points."

    def build(self, rng, d):
        # 1.12^d points up to difficulty 30 (179), then 10 per level (879 at 100): 1.12^100 points filled megabytes
        n = grow_until(5, d, 30, 10, 1.12, 1)
        # a square of side 8n: ~n^2 / 2 pairs over ~64 n^2 cells leave the closest pair some 40 apart (squared), 1 on a
        # few percent of the problems (a side of 10 + 5d made 1 the answer of 60-90% from difficulty 40)
        pts = list(set(_pts(rng, n, max(10 + 5 * d, 4 * n))))
        best = closest_pair_sq(pts)
        return f"Points: {_show(pts)}. What is the smallest squared Euclidean distance between two of them?", best


def segments_intersect(p1, p2, p3, p4):
    d1, d2, d3, d4 = cross(p3, p4, p1), cross(p3, p4, p2), cross(p1, p2, p3), cross(p1, p2, p4)
    if ((d1 > 0) != (d2 > 0)) and d1 and d2 and ((d3 > 0) != (d4 > 0)) and d3 and d4:
        return True
    return (d1 == 0 and _on_segment(p1, p3, p4)) or (d2 == 0 and _on_segment(p2, p3, p4)) or \
        (d3 == 0 and _on_segment(p3, p1, p2)) or (d4 == 0 and _on_segment(p4, p1, p2))


@register("gym/segment_intersection")
class SegmentIntersection(ListAnswer):
    family, description = F, "Do pairs of closed segments intersect?"

    def build(self, rng, d):
        r = 5 + 2 * d
        pairs = []
        for _ in range(3 + d // 2):  # each pair meets or not with even odds (random segments mostly miss)
            want = rng.random() < 0.5
            for _ in range(40):
                p = _pts(rng, 4, r)
                if segments_intersect(*p) == want:
                    break
            pairs.append(p)
        shown = "; ".join(f"[{_show(p[:2])}] and [{_show(p[2:])}]" for p in pairs)
        return (f"For each pair of closed segments {shown}, answer 1 if they share at least one point, else 0, separated "
                f"by spaces.", [int(segments_intersect(*p)) for p in pairs])


@register("gym/rectangle_union_area")
class RectangleUnionArea(IntAnswer):
    family, description = F, "Area of the union of axis-aligned rectangles."

    def build(self, rng, d):
        rects = []
        for _ in range(grow_until(2, d, 30, 5, 1.1, 0.7)):  # 55 rectangles at difficulty 30, then 5 per level
            x, y = rng.randint(0, 10 + 3 * d), rng.randint(0, 10 + 3 * d)
            rects.append((x, y, x + rng.randint(1, 6 + d), y + rng.randint(1, 6 + d)))
        xs = sorted({v for r in rects for v in (r[0], r[2])})
        area = 0
        for xa, xb in zip(xs, xs[1:]):
            ivs = sorted((r[1], r[3]) for r in rects if r[0] <= xa and r[2] >= xb)
            cover, end = 0, None
            for lo, hi in ivs:
                if end is None or lo > end:
                    cover, end = cover + hi - lo, hi
                elif hi > end:
                    cover, end = cover + hi - end, hi
            area += cover * (xb - xa)
        shown = ", ".join(f"[{a}, {c}] x [{b}, {e}]" for a, b, c, e in rects)
        return f"What is the area of the union of the rectangles {shown} (x-range x y-range)?", area


@register("gym/circle_lattice_points")
class CircleLatticePoints(IntAnswer):
    family, description = F, "Lattice points inside a circle (Gauss circle problem)."

    def build(self, rng, d):
        r2 = rng.randint(2, grow_until(20, d, 30, 2 * 10 ** 6, 1.5))  # 1.5^d to difficulty 30 (3.8e6), then linear
        cnt = sum(2 * math.isqrt(r2 - x * x) + 1 for x in range(-math.isqrt(r2), math.isqrt(r2) + 1))
        return f"How many integer points (x, y) satisfy x^2 + y^2 <= {r2}?", cnt


@register("gym/max_collinear")
class MaxCollinear(IntAnswer):
    family, description = F, "Maximum number of given points on one straight line."

    def build(self, rng, d):
        if d < 4:
            # 4 (or 3) was the answer of 35-52% of the problems: an answer drawn uniformly from 3..5 (..6 from
            # difficulty 2) is the target, the points drawn again until they have it
            target = rng.randint(3, 5 + d // 2)
            return balanced(rng, lambda: self._draw(rng, d), lambda ans: ans != target, keep=0.0, tries=100)
        return self._draw(rng, d)

    def _draw(self, rng, d):
        r = 4 + d
        # exponential up to difficulty 40 (266 points), then 4 per level (506 at 100): the O(n^2) count over pairs
        # took 11 s at difficulty 80 (2300 points, a 94k-character prompt)
        pts = set(_pts(rng, grow_until(5, d, 40, 4), r))
        x, y = rng.randint(-r, r), rng.randint(-r, r)
        dx, dy = rng.choice([(1, 0), (0, 1), (1, 1), (1, -1), (1, 2), (2, 1)])
        pts |= {(x + k * dx, y + k * dy) for k in range(rng.randint(3, 4 + d // 2))}
        pts = sorted(pts)
        rng.shuffle(pts)
        best = 1
        for i, a in enumerate(pts):
            cnt: dict = {}
            for b in pts[i + 1:]:
                ddx, ddy = b[0] - a[0], b[1] - a[1]
                g = math.gcd(ddx, ddy)
                ddx, ddy = ddx // g, ddy // g
                if ddx < 0 or (ddx == 0 and ddy < 0):
                    ddx, ddy = -ddx, -ddy
                cnt[(ddx, ddy)] = cnt.get((ddx, ddy), 0) + 1
            best = max([best] + [c + 1 for c in cnt.values()])
        return f"Points: {_show(pts)}. What is the maximum number of these points that lie on one straight line?", best
