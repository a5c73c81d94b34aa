"""Graphs: paths, trees, flows, matchings, colourings, orders and connectivity.

Vertices are numbered 0..n-1. Answers that can take several valid forms (paths, spanning trees,
colourings, orders, matchings) are checked for validity and optimality, not equality.
"""
from __future__ import annotations

import heapq
from collections import deque

from envs.base import register
from envs.gym._util import (
    INVALID, MOD, GymEnv, IntAnswer, ListAnswer, StrAnswer, balanced, fmt_edges, fmt_list, grow_until,
    parse_groups, parse_int_list, parse_path, random_connected_graph, random_tree,
)

F = "graphs"


def _n(d, base=5, per_level=3):
    """1.1^d vertices up to difficulty 30 (117 for base 5), then ``per_level`` more per level (327 at 100 for 3):
    exponential sizes made megabyte prompts (graph_coloring 3M characters at 100) and minutes-long solvers."""
    return grow_until(base, d, 30, per_level)


def adj_list(n, edges, directed=False):
    adj = [[] for _ in range(n)]
    for e in edges:
        u, v, w = (e[0], e[1], e[2] if len(e) > 2 else 1)
        adj[u].append((v, w))
        if not directed:
            adj[v].append((u, w))
    return adj


def dijkstra(adj, s):
    dist = [None] * len(adj)
    pq = [(0, s)]
    while pq:
        d0, u = heapq.heappop(pq)
        if dist[u] is not None:
            continue
        dist[u] = d0
        for v, w in adj[u]:
            if dist[v] is None:
                heapq.heappush(pq, (d0 + w, v))
    return dist


def bfs(adj, s):
    dist = [-1] * len(adj)
    dist[s] = 0
    q = deque([s])
    while q:
        u = q.popleft()
        for v, _ in adj[u]:
            if dist[v] < 0:
                dist[v] = dist[u] + 1
                q.append(v)
    return dist


def _wgraph_text(n, edges, directed=False):
    kind = "A directed" if directed else "An undirected"
    return f"{kind} weighted graph has {n} vertices 0..{n - 1} and these edges (u v weight):\n{fmt_edges(edges, True)}"


def _graph_text(n, edges, directed=False):
    kind = "A directed" if directed else "An undirected"
    return f"{kind} graph has {n} vertices 0..{n - 1} and these edges (u v):\n{fmt_edges(edges)}"


def _none_or_ints(text, k):
    if text.strip().lower() in ("none", "empty", "{}", "[]", "\\emptyset", "∅"):
        return []
    return parse_groups(text, k)


class _ValidityGraphEnv(GymEnv):
    def format_answer(self, answer):
        return fmt_list(answer)


@register("gym/shortest_path_length")
class ShortestPathLength(IntAnswer):
    family, description = F, "Weighted shortest-path distance (Dijkstra)."

    def build(self, rng, d):
        n = _n(d)
        edges = random_connected_graph(rng, n, int(n * 1.6), 10 + 2 * d)
        s, t = rng.sample(range(n), 2)
        return f"{_wgraph_text(n, edges)}\nWhat is the length of the shortest path from {s} to {t}?", \
            dijkstra(adj_list(n, edges), s)[t]


def _path_weight(n, edges, path):
    w = {}
    for u, v, c in edges:
        w[(u, v)] = w[(v, u)] = min(c, w.get((u, v), c))
    if any(not 0 <= x < n for x in path):
        return None
    total = 0
    for a, b in zip(path, path[1:]):
        if (a, b) not in w:
            return None
        total += w[(a, b)]
    return total


@register("gym/shortest_path")
class ShortestPath(_ValidityGraphEnv):
    family, description = F, "Give a minimum-weight path (any optimal one is accepted)."

    def build(self, rng, d):
        n = _n(d)
        edges = random_connected_graph(rng, n, int(n * 1.6), 10 + 2 * d)
        s, t = rng.sample(range(n), 2)
        adj = adj_list(n, edges)
        dist = dijkstra(adj, s)
        path = [t]
        while path[-1] != s:
            u = path[-1]
            path.append(next(v for v, w in adj[u] if dist[v] is not None and dist[v] + w == dist[u]))
        return (f"{_wgraph_text(n, edges)}\nGive a shortest path from {s} to {t} as the sequence of vertices "
                f"separated by spaces.", path[::-1], {"n": n, "edges": edges, "dist": dist[t]})

    def parse(self, text, problem):
        return parse_path(text)

    def grade(self, problem, value):
        m = problem.meta
        if not value or value[0] != problem.answer[0] or value[-1] != problem.answer[-1]:
            return INVALID
        w = _path_weight(m["n"], m["edges"], value)
        if w is None:
            return INVALID
        return (m["dist"] / w) ** 5 if w else 1.0

    def wrong_answers(self, problem):
        p = problem.answer
        return [fmt_list(p[:-1]), fmt_list(p + [p[-2], p[-1]]), fmt_list([p[0], p[0], p[-1]]), fmt_list(p[::-1])]


class DSU:
    def __init__(self, n):
        self.p = list(range(n))

    def find(self, x):
        while self.p[x] != x:
            self.p[x] = self.p[self.p[x]]
            x = self.p[x]
        return x

    def union(self, a, b):
        a, b = self.find(a), self.find(b)
        if a == b:
            return False
        self.p[a] = b
        return True


def kruskal(n, edges):
    dsu, tree = DSU(n), []
    for u, v, w in sorted(edges, key=lambda e: e[2]):
        if dsu.union(u, v):
            tree.append((u, v, w))
    return tree


@register("gym/mst_weight")
class MSTWeight(IntAnswer):
    family, description = F, "Total weight of a minimum spanning tree."

    def build(self, rng, d):
        n = _n(d)
        edges = random_connected_graph(rng, n, int(n * 1.8), 20 + 3 * d)
        return f"{_wgraph_text(n, edges)}\nWhat is the total weight of a minimum spanning tree?", \
            sum(w for *_, w in kruskal(n, edges))


@register("gym/mst_edges")
class MSTEdges(GymEnv):
    family, description = F, "Give the edges of a minimum spanning tree (any optimal tree is accepted)."

    def build(self, rng, d):
        n = _n(d)
        edges = random_connected_graph(rng, n, int(n * 1.8), 5 + d)
        tree = kruskal(n, edges)
        return (f"{_wgraph_text(n, edges)}\nGive the edges of a minimum spanning tree as pairs 'u v' separated by "
                f"commas.", [[u, v] for u, v, _ in tree], {"n": n, "edges": edges, "w": sum(w for *_, w in tree)})

    def format_answer(self, answer):
        return ", ".join(f"{u} {v}" for u, v in answer)

    def parse(self, text, problem):
        return parse_groups(text, 2)

    def grade(self, problem, value):
        n, edges = problem.meta["n"], problem.meta["edges"]
        w = {}
        for u, v, c in edges:
            w[(u, v)] = w[(v, u)] = c
        if len(value) != n - 1 or any(e not in w for e in value):
            return INVALID
        dsu = DSU(n)
        if not all(dsu.union(u, v) for u, v in value):
            return INVALID
        return (problem.meta["w"] / sum(w[e] for e in value)) ** 5

    def wrong_answers(self, problem):
        a = problem.answer
        n, edges = problem.meta["n"], problem.meta["edges"]
        tree = {tuple(sorted(e)) for e in a}
        heavier = None  # swap one tree edge for a heavier non-tree edge that keeps a spanning tree
        for u, v, c in sorted(edges, key=lambda e: -e[2]):
            if (min(u, v), max(u, v)) in tree:
                continue
            for i in range(len(a)):
                cand = a[:i] + a[i + 1:] + [[u, v]]
                dsu = DSU(n)
                if all(dsu.union(x, y) for x, y in cand):
                    cost = sum(next(w for p, q, w in edges if {p, q} == {x, y}) for x, y in cand)
                    if cost > problem.meta["w"]:
                        heavier = cand
                        break
            if heavier:
                break
        out = [self.format_answer(a[:-1]), self.format_answer(a[:-1] + [a[0]])]
        if heavier:
            out.append(self.format_answer(heavier))
        return out


@register("gym/graph_coloring")
class GraphColoring(_ValidityGraphEnv):
    family, description = F, "Proper k-colouring of a graph (any valid colouring is accepted)."

    def build(self, rng, d):
        n, k = _n(d), 3 + d // 8
        col = [rng.randrange(k) for _ in range(n)]
        col[0], col[1] = 0, 1  # at least two colours, so there is at least one possible edge
        edges = {(0, 1)}
        for _ in range(n * 4):
            u, v = rng.sample(range(n), 2)
            if col[u] != col[v]:
                edges.add((min(u, v), max(u, v)))
        edges = sorted(edges)
        rng.shuffle(edges)
        return (f"{_graph_text(n, edges)}\nColour the vertices with colours 0..{k - 1} so that adjacent vertices get "
                f"different colours. Answer the colours of vertices 0..{n - 1} in order, separated by spaces.",
                col, {"k": k, "edges": edges})

    def parse(self, text, problem):
        return parse_int_list(text)

    def grade(self, problem, value):
        k, edges = problem.meta["k"], problem.meta["edges"]
        if len(value) != len(problem.answer) or any(not 0 <= c < k for c in value):
            return INVALID
        ok = sum(value[u] != value[v] for u, v in edges)
        return (ok / len(edges)) ** 10 if edges else 1.0

    def wrong_answers(self, problem):
        c, edges = problem.answer, problem.meta["edges"]
        bad = c[:]
        u, v = edges[0]
        bad[u] = bad[v]
        return [fmt_list(bad), fmt_list(c[:-1]), fmt_list([problem.meta["k"]] + c[1:])]


def max_flow(n, cap_edges, s, t):
    cap = [[0] * n for _ in range(n)]
    nbr = [set() for _ in range(n)]  # both directions of every arc: the residual graph's possible arcs
    for u, v, c in cap_edges:
        cap[u][v] += c
        nbr[u].add(v)
        nbr[v].add(u)
    nbr = [sorted(x) for x in nbr]  # the order of the full scan over range(n): the same augmenting paths
    flow = 0
    while True:
        par = [-1] * n
        par[s] = s
        q = deque([s])
        while q and par[t] < 0:
            u = q.popleft()
            for v in nbr[u]:
                if par[v] < 0 and cap[u][v] > 0:
                    par[v] = u
                    q.append(v)
        if par[t] < 0:
            return flow
        b, v = float("inf"), t
        while v != s:
            b, v = min(b, cap[par[v]][v]), par[v]
        v = t
        while v != s:
            cap[par[v]][v] -= b
            cap[v][par[v]] += b
            v = par[v]
        flow += b


@register("gym/max_flow")
class MaxFlow(IntAnswer):
    family, description = F, "Maximum flow value in a directed capacitated network."

    def build(self, rng, d):
        n = _n(d)
        edges = {}
        for _ in range(int(n * 2.2)):
            u, v = rng.sample(range(n), 2)
            edges[(u, v)] = rng.randint(1, 10 + 2 * d)
        for i in range(n - 1):  # keep the sink reachable
            edges.setdefault((i, i + 1), rng.randint(1, 10 + 2 * d))
        el = [(u, v, c) for (u, v), c in edges.items()]
        rng.shuffle(el)
        return (f"A directed network has {n} vertices 0..{n - 1} and these arcs (u v capacity):\n"
                f"{fmt_edges(el, True)}\nWhat is the maximum flow from 0 to {n - 1}?", max_flow(n, el, 0, n - 1))


@register("gym/topological_order")
class TopologicalOrder(_ValidityGraphEnv):
    family, description = F, "A topological order of a DAG (any valid order is accepted)."

    def build(self, rng, d):
        n = _n(d)
        order = list(range(n))
        rng.shuffle(order)
        pos = {v: i for i, v in enumerate(order)}
        edges = set()
        for _ in range(int(n * 1.5)):
            u, v = rng.sample(range(n), 2)
            edges.add((u, v) if pos[u] < pos[v] else (v, u))
        edges = sorted(edges)
        rng.shuffle(edges)
        return (f"{_graph_text(n, edges, True)}\nGive a topological order of the vertices (every edge u v has u "
                f"before v), separated by spaces.", order, {"edges": edges})

    def parse(self, text, problem):
        return parse_int_list(text)

    def grade(self, problem, value):
        n = len(problem.answer)
        if sorted(value) != list(range(n)):
            return INVALID
        pos = {v: i for i, v in enumerate(value)}
        return 1.0 if all(pos[u] < pos[v] for u, v in problem.meta["edges"]) else 0.0

    def wrong_answers(self, problem):
        o = problem.answer
        u, v = problem.meta["edges"][0]
        bad = [x if x not in (u, v) else (v if x == u else u) for x in o]
        return [fmt_list(bad), fmt_list(o[:-1]), fmt_list(o + [o[0]])]


@register("gym/bipartite_check")
class BipartiteCheck(GymEnv):
    family, description = F, "2-colour a graph, or say NO if it is not bipartite."

    def build(self, rng, d):
        n = _n(d, 6)
        side = [rng.randrange(2) for _ in range(n)]
        edges = set()
        for _ in range(int(n * 1.3)):
            u, v = rng.sample(range(n), 2)
            if side[u] != side[v]:
                edges.add((min(u, v), max(u, v)))
        if rng.random() < 0.5:
            same = [(u, v) for u in range(n) for v in range(u + 1, n) if side[u] == side[v]]
            edges.add(rng.choice(same))
        edges = sorted(edges)
        adj = adj_list(n, edges)
        col = [-1] * n
        ans = None
        for s in range(n):
            if col[s] >= 0:
                continue
            col[s] = 0
            q = deque([s])
            while q:
                u = q.popleft()
                for v, _ in adj[u]:
                    if col[v] < 0:
                        col[v] = 1 - col[u]
                        q.append(v)
                    elif col[v] == col[u]:
                        ans = "NO"
        rng.shuffle(edges)
        return (f"{_graph_text(n, edges)}\nIf the graph is bipartite, give a 2-colouring: the colours (0 or 1) of "
                f"vertices 0..{n - 1} separated by spaces, adjacent vertices differing. Otherwise answer NO.",
                ans or col, {"edges": edges, "n": n})

    def format_answer(self, answer):
        return answer if answer == "NO" else fmt_list(answer)

    def parse(self, text, problem):
        if text.strip().upper().rstrip(".") == "NO":
            return "NO"
        return parse_int_list(text)

    def grade(self, problem, value):
        if problem.answer == "NO" or value == "NO":
            return 1.0 if value == problem.answer else 0.0
        if len(value) != problem.meta["n"] or any(c not in (0, 1) for c in value):
            return INVALID
        return 1.0 if all(value[u] != value[v] for u, v in problem.meta["edges"]) else 0.0

    def wrong_answers(self, problem):
        n = problem.meta["n"]
        if problem.answer == "NO":
            return [fmt_list([0] * n), "YES"]
        bad = problem.answer[:]
        u, v = problem.meta["edges"][0] if problem.meta["edges"] else (0, 1)
        bad[u] = bad[v] if problem.meta["edges"] else 2
        return ["NO", fmt_list(bad), fmt_list(problem.answer[:-1])]


def components(n, edges):
    dsu = DSU(n)
    for u, v, *_ in edges:
        dsu.union(u, v)
    return len({dsu.find(i) for i in range(n)})


@register("gym/connected_components")
class ConnectedComponents(IntAnswer):
    family, description = F, "Number of connected components."

    def build(self, rng, d):
        n = _n(d, 6)
        # n/3 to n edges, not 0.7 n: with a fixed count the answer was one number on 65% of the problems at difficulty 1
        edges = sorted({tuple(sorted(rng.sample(range(n), 2))) for _ in range(rng.randint(n // 3, n))})
        rng.shuffle(edges)
        return f"{_graph_text(n, edges)}\nHow many connected components does the graph have?", components(n, edges)


def _blocky_graph(rng, n):
    """A connected graph made of dense blocks joined by single edges (so it has bridges)."""
    verts = list(range(n))
    rng.shuffle(verts)
    blocks, i = [], 0
    while i < n:
        k = rng.randint(1, 4)
        blocks.append(verts[i:i + k])
        i += k
    edges = set()
    for b in blocks:
        for j in range(len(b)):
            if len(b) > 2 or j + 1 < len(b):
                u, v = b[j], b[(j + 1) % len(b)]
                edges.add((min(u, v), max(u, v)))
    for j in range(1, len(blocks)):
        u, v = rng.choice(blocks[j]), rng.choice(blocks[rng.randrange(j)])
        edges.add((min(u, v), max(u, v)))
    out = sorted(edges)
    rng.shuffle(out)
    return out


def low_link(n, edges):
    """Bridges and articulation points (iterative Tarjan)."""
    adj = [[] for _ in range(n)]
    for i, (u, v) in enumerate(edges):
        adj[u].append((v, i))
        adj[v].append((u, i))
    tin, low, timer = [-1] * n, [0] * n, 0
    bridges, arts = [], set()
    for root in range(n):
        if tin[root] >= 0:
            continue
        tin[root] = low[root] = timer
        timer += 1
        stack, children = [(root, -1, iter(adj[root]))], 0
        while stack:
            u, pe, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                if stack:
                    p = stack[-1][0]
                    low[p] = min(low[p], low[u])
                    if low[u] > tin[p]:
                        bridges.append((min(u, p), max(u, p)))
                    if low[u] >= tin[p] and p != root:
                        arts.add(p)
                continue
            v, ei = nxt
            if ei == pe:
                continue
            if tin[v] >= 0:
                low[u] = min(low[u], tin[v])
            else:
                tin[v] = low[v] = timer
                timer += 1
                if u == root:
                    children += 1
                stack.append((v, ei, iter(adj[v])))
        if children > 1:
            arts.add(root)
    return sorted(bridges), sorted(arts)


@register("gym/bridges")
class Bridges(GymEnv):
    family, description = F, "All bridges of an undirected graph."

    def build(self, rng, d):
        n = _n(d, 6)
        edges = _blocky_graph(rng, n)
        return (f"{_graph_text(n, edges)}\nList all bridges (edges whose removal disconnects the graph) as pairs "
                f"'u v' separated by commas, or 'none'.", [list(e) for e in low_link(n, edges)[0]])

    def format_answer(self, answer):
        return ", ".join(f"{u} {v}" for u, v in answer) or "none"

    def parse(self, text, problem):
        return sorted({(min(e), max(e)) for e in _none_or_ints(text, 2)})

    def grade(self, problem, value):
        return 1.0 if value == [tuple(e) for e in problem.answer] else 0.0

    def wrong_answers(self, problem):
        a = problem.answer
        return [self.format_answer(a[:-1]), self.format_answer(a + [[0, 10 ** 6]])]


@register("gym/articulation_points")
class ArticulationPoints(GymEnv):
    family, description = F, "All articulation points (cut vertices) of an undirected graph."

    def build(self, rng, d):
        n = _n(d, 6)
        edges = _blocky_graph(rng, n)
        return (f"{_graph_text(n, edges)}\nList all articulation points (vertices whose removal disconnects the "
                f"graph) in increasing order separated by spaces, or 'none'.", low_link(n, edges)[1])

    def format_answer(self, answer):
        return fmt_list(answer) or "none"

    def parse(self, text, problem):
        if text.strip().lower() in ("none", "empty", "{}", "[]", "\\emptyset", "∅"):
            return []
        return sorted(set(parse_int_list(text)))

    def grade(self, problem, value):
        return 1.0 if value == problem.answer else 0.0

    def wrong_answers(self, problem):
        a = problem.answer
        return [self.format_answer(a[:-1]) if a else "0", self.format_answer(a + [10 ** 6])]


@register("gym/euler_path")
class EulerPath(_ValidityGraphEnv):
    family, description = F, "A trail using every edge exactly once (any valid one)."

    def build(self, rng, d):
        n = _n(d, 5, 2)
        cur = rng.randrange(n)
        walk, used = [cur], set()
        for _ in range(grow_until(6, d, 30, 5, 1.15, 2)):  # 1.15^d steps to difficulty 30 (457), then 5 per level
            opts = [v for v in range(n) if v != cur and (min(cur, v), max(cur, v)) not in used]
            if not opts:
                break
            v = rng.choice(opts)
            used.add((min(cur, v), max(cur, v)))
            walk.append(v)
            cur = v
        edges = sorted(used)
        rng.shuffle(edges)
        return (f"{_graph_text(n, edges)}\nGive a path that traverses every edge exactly once, as the sequence of "
                f"visited vertices separated by spaces.", walk, {"edges": edges})

    def parse(self, text, problem):
        return parse_path(text)

    def grade(self, problem, value):
        edges = {tuple(e) for e in problem.meta["edges"]}
        steps = [(min(a, b), max(a, b)) for a, b in zip(value, value[1:])]
        if len(steps) != len(edges) or any(s not in edges for s in steps):
            return INVALID
        return 1.0 if len(set(steps)) == len(edges) else 0.0

    def wrong_answers(self, problem):
        w = problem.answer
        return [fmt_list(w[:-1]), fmt_list(w + [w[-2]]), fmt_list(w[:2] + w[:2][::-1] + w[2:-2]) if len(w) > 3 else "0 0"]


@register("gym/lca_queries")
class LCAQueries(ListAnswer):
    family, description = F, "Lowest common ancestors in a rooted tree."

    def build(self, rng, d):
        return balanced(rng, lambda: self._draw(rng, d), lambda ans: not any(ans))

    def _draw(self, rng, d):
        n = _n(d, 6)
        # half the vertices hang below one of the last three (deep branches: not every LCA is the root)
        par = [-1] + [rng.randrange(max(0, i - 3) if rng.random() < 0.5 else 0, i) for i in range(1, n)]
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[par[i]] + 1

        def lca(a, b):
            while a != b:
                if depth[a] < depth[b]:
                    a, b = b, a
                a = par[a]
            return a

        qs = [tuple(rng.sample(range(n), 2)) for _ in range(2 + d // 2)]
        shown = ", ".join(f"({a}, {b})" for a, b in qs)
        return (f"A tree rooted at 0 has {n} vertices; the parent of vertex i (for i = 1..{n - 1}) is "
                f"{fmt_list(par[1:])} respectively. For each query pair {shown} give the lowest common ancestor, "
                f"separated by spaces.", [lca(a, b) for a, b in qs])


@register("gym/tree_diameter")
class TreeDiameter(IntAnswer):
    family, description = F, "Weighted diameter of a tree."

    def build(self, rng, d):
        n = _n(d, 5)
        edges = [(u, v, rng.randint(1, 10 + d)) for u, v in random_tree(rng, n)]
        adj = adj_list(n, edges)
        far = dijkstra(adj, 0)
        a = far.index(max(far))
        return f"{_wgraph_text(n, edges)}\nThis graph is a tree. What is the length of its longest path?", \
            max(dijkstra(adj, a))


def kuhn(nl, adj):
    match_r = {}

    def try_(u, seen):
        for v in adj[u]:
            if v in seen:
                continue
            seen.add(v)
            if v not in match_r or try_(match_r[v], seen):
                match_r[v] = u
                return True
        return False

    for u in range(nl):
        try_(u, set())
    return sorted((u, v) for v, u in match_r.items())


@register("gym/bipartite_matching")
class BipartiteMatching(GymEnv):
    family, description = F, "A maximum matching of a bipartite graph (any maximum one)."

    def build(self, rng, d):
        nl, nr = _n(d, 4), _n(d, 4)
        edges = sorted({(rng.randrange(nl), rng.randrange(nr)) for _ in range(int((nl + nr) * 1.2))})
        adj = [[] for _ in range(nl)]
        for u, v in edges:  # sorted: each list in increasing order, as before
            adj[u].append(v)
        m = kuhn(nl, adj)
        rng.shuffle(edges)
        shown = ", ".join(f"L{u}-R{v}" for u, v in edges)
        return (f"A bipartite graph has left vertices L0..L{nl - 1}, right vertices R0..R{nr - 1} and edges {shown}. "
                f"Give a maximum matching as pairs 'u v' (meaning Lu-Rv) separated by commas.",
                [list(e) for e in m], {"edges": edges})

    def format_answer(self, answer):
        return ", ".join(f"{u} {v}" for u, v in answer)

    def parse(self, text, problem):
        return parse_groups(text.replace("L", "").replace("R", ""), 2)

    def grade(self, problem, value):
        edges = {tuple(e) for e in problem.meta["edges"]}
        if any(e not in edges for e in value) or len({u for u, _ in value}) < len(value) \
                or len({v for _, v in value}) < len(value):
            return INVALID
        return (len(value) / len(problem.answer)) ** 5

    def wrong_answers(self, problem):
        a = problem.answer
        out = [self.format_answer(a[:-1])]
        if a:
            out.append(self.format_answer(a + [a[0]]))
        return out


def scc_count(n, edges):
    adj, radj = [[] for _ in range(n)], [[] for _ in range(n)]
    for u, v in edges:
        adj[u].append(v)
        radj[v].append(u)
    order, seen = [], [False] * n
    for s in range(n):
        if seen[s]:
            continue
        seen[s] = True
        st = [(s, iter(adj[s]))]
        while st:
            u, it = st[-1]
            v = next(it, None)
            if v is None:
                order.append(u)
                st.pop()
            elif not seen[v]:
                seen[v] = True
                st.append((v, iter(adj[v])))
    comp, c = [-1] * n, 0
    for s in reversed(order):
        if comp[s] >= 0:
            continue
        comp[s], st = c, [s]
        while st:
            u = st.pop()
            for v in radj[u]:
                if comp[v] < 0:
                    comp[v] = c
                    st.append(v)
        c += 1
    return c


@register("gym/scc_count")
class SCCCount(IntAnswer):
    family, description = F, "Number of strongly connected components of a directed graph."

    def build(self, rng, d):
        n = _n(d, 6)
        edges = sorted({tuple(rng.sample(range(n), 2)) for _ in range(int(n * 1.3))})
        rng.shuffle(edges)
        return f"{_graph_text(n, edges, True)}\nHow many strongly connected components does it have?", scc_count(n, edges)


@register("gym/girth")
class Girth(IntAnswer):
    family, description = F, "Length of the shortest cycle of an undirected graph."

    def build(self, rng, d):
        # exponential up to difficulty 30 (117 vertices), then 4 per level (397 at 100): a BFS from every vertex
        # took seconds past difficulty 70, and the edge list ran to 100k characters
        n = grow_until(5, d, 30, 4)
        if d < 30:
            # 3 or 4 was the answer of 36-56% of the problems (of the raw draws, 3 was on 40-80%): a girth drawn
            # uniformly from 3..5 (..7 from difficulty 10) is the target, the graph drawn again until it has it
            target = rng.randint(3, min(n, 5 + min(2, d // 5)))
            return balanced(rng, lambda: self._draw(rng, d, n), lambda ans: ans != target, keep=0.0, tries=200)
        return balanced(rng, lambda: self._draw(rng, d, n), lambda ans: ans == 3)

    def _draw(self, rng, d, n):
        edges = random_connected_graph(rng, n, rng.randint(n, n + 1 + d // 3))  # n edges: one cycle, of any length
        adj = adj_list(n, edges)
        best = None
        for s in range(n):
            dist, par = [-1] * n, [-1] * n
            dist[s] = 0
            q = deque([s])
            while q:
                u = q.popleft()
                for v, _ in adj[u]:
                    if dist[v] < 0:
                        dist[v], par[v] = dist[u] + 1, u
                        q.append(v)
                    elif par[u] != v:
                        c = dist[u] + dist[v] + 1
                        best = c if best is None else min(best, c)
        return f"{_graph_text(n, edges)}\nWhat is the length (number of edges) of the shortest cycle?", best


@register("gym/maze_shortest_path")
class MazeShortestPath(IntAnswer):
    family, description = F, "Fewest moves through a grid maze (BFS)."

    def build(self, rng, d):
        # exponential up to difficulty 35 (80 x 94), then half a row and a column per level (112 x 126 at 100): the
        # maze alone was 240k characters at difficulty 60
        r, c = grow_until(4, d, 35, 0.5, 1.08, 0.6), grow_until(5, d, 35, 0.5, 1.08, 0.6)
        # most open mazes have a straight route from S to E, whose length the prompt gives away (corner to corner:
        # r + c - 2 at almost every seed): those are kept one time in twenty
        for _ in range(40):
            prompt, answer, straight = self._draw(rng, r, c)
            if not straight or rng.random() < 0.05:
                break
        return prompt, answer

    def _draw(self, rng, r, c):
        while True:
            wall = rng.uniform(0.2, 0.45)
            g = [["#" if rng.random() < wall else "." for _ in range(c)] for _ in range(r)]
            s, e = rng.sample([(i, j) for i in range(r) for j in range(c)], 2)
            g[s[0]][s[1]], g[e[0]][e[1]] = "S", "E"
            dist = {s: 0}
            q = deque([s])
            while q:
                i, j = q.popleft()
                for a, b in ((i + 1, j), (i - 1, j), (i, j + 1), (i, j - 1)):
                    if 0 <= a < r and 0 <= b < c and g[a][b] != "#" and (a, b) not in dist:
                        dist[(a, b)] = dist[(i, j)] + 1
                        q.append((a, b))
            if e in dist:
                break
        maze = "\n".join("".join(row) for row in g)
        straight = dist[e] == abs(s[0] - e[0]) + abs(s[1] - e[1])
        return (f"In the maze below you move up/down/left/right through '.' cells, never through '#'. What is the "
                f"minimum number of moves from S to E?\n{maze}", dist[e], straight)


def det_mod(m, p=MOD):
    m = [[x % p for x in row] for row in m]
    n, res = len(m), 1
    for c in range(n):
        piv = next((r for r in range(c, n) if m[r][c]), None)
        if piv is None:
            return 0
        if piv != c:
            m[c], m[piv] = m[piv], m[c]
            res = -res
        res = res * m[c][c] % p
        inv = pow(m[c][c], p - 2, p)
        for r in range(c + 1, n):
            f = m[r][c] * inv % p
            if f:
                m[r] = [(x - f * y) % p for x, y in zip(m[r], m[c])]
    return res % p


@register("gym/count_spanning_trees")
class CountSpanningTrees(IntAnswer):
    family, description = F, "Number of spanning trees (matrix-tree theorem)."

    def build(self, rng, d):
        n = 5 + d // 2  # fewer than all n (n - 1) / 2 edges (K3 and K4 at every seed made one answer per level)
        edges = random_connected_graph(rng, n, rng.randint(n, min(int(n * 1.6), n * (n - 1) // 2 - 1)))
        lap = [[0] * n for _ in range(n)]
        for u, v in edges:
            lap[u][u] += 1
            lap[v][v] += 1
            lap[u][v] -= 1
            lap[v][u] -= 1
        minor = [row[1:] for row in lap[1:]]
        return (f"{_graph_text(n, edges)}\nHow many spanning trees does it have? Give the answer modulo 1000000007.",
                det_mod(minor))


@register("gym/dag_longest_path")
class DagLongestPath(IntAnswer):
    family, description = F, "Maximum-weight path in a weighted DAG."

    def build(self, rng, d):
        n = _n(d)
        edges = {}
        for _ in range(int(n * 1.6)):
            u, v = sorted(rng.sample(range(n), 2))
            edges[(u, v)] = rng.randint(1, 10 + d)
        perm = list(range(n))
        rng.shuffle(perm)
        el = [(perm[u], perm[v], w) for (u, v), w in edges.items()]
        best = [0] * n
        for (u, v), w in sorted(edges.items()):
            best[v] = max(best[v], best[u] + w)
        rng.shuffle(el)
        return f"{_wgraph_text(n, el, True)}\nThe graph is acyclic. What is the maximum total weight of a directed path?", max(best)


@register("gym/count_shortest_paths")
class CountShortestPaths(IntAnswer):
    family, description = F, "Number of distinct shortest paths in an unweighted graph."

    def build(self, rng, d):
        return balanced(rng, lambda: self._draw(rng, d), lambda ans: ans == 1)

    def _draw(self, rng, d):
        n = _n(d, 6)
        edges = random_connected_graph(rng, n, int(n * 1.8))
        adj = adj_list(n, edges)
        s, t = rng.sample(range(n), 2)
        dist = bfs(adj, s)
        ways = [0] * n
        ways[s] = 1
        for u in sorted(range(n), key=lambda x: dist[x]):
            for v, _ in adj[u]:
                if dist[v] == dist[u] + 1:
                    ways[v] += ways[u]
        return (f"{_graph_text(n, edges)}\nHow many different shortest paths (fewest edges) lead from {s} to {t}? "
                f"Give the answer modulo 1000000007.", ways[t] % MOD)


def _graphical(deg: list[int]) -> bool:
    """Erdos-Gallai: the degrees of some simple graph."""
    ds, n = sorted(deg, reverse=True), len(deg)
    if sum(ds) % 2:
        return False
    # for each k: sum(ds[:k]) <= k (k - 1) + sum(min(x, k) for x in ds[k:]), in O(n) after the sort: the x >= k
    # among ds[k:] are ds[k:j] (non-increasing), j found by a pointer that only moves left as k grows
    suffix = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix[i] = suffix[i + 1] + ds[i]
    j, left = n, 0
    for k in range(1, n + 1):
        left += ds[k - 1]
        while j > 0 and ds[j - 1] < k:
            j -= 1
        big = max(j - k, 0)  # ds[k:max(j, k)] are >= k
        if left > k * (k - 1) + big * k + suffix[max(j, k)]:
            return False
    return True


@register("gym/graphical_sequence")
class GraphicalSequence(StrAnswer):
    family, description, fold_case = F, "Is a degree sequence graphical (Erdos-Gallai)? YES/NO.", True

    def build(self, rng, d):
        # YES and NO are the two sides of one step across the Erdos-Gallai boundary: a simple graph's degrees
        # (graphical) concentrated a unit at a time (from a lower to a higher degree, mostly) until they are not;
        # the sequences just before and just after have the same sum and nearly the same maximum and spread (NO
        # sequences made otherwise were told apart by their degree sum or a degree of n-1 on 91-100% of problems)
        n = _n(d, 5, 5)
        want = rng.random() < 0.5
        edges = {tuple(sorted(rng.sample(range(n), 2))) for _ in range(rng.randint(n // 2, int(n * 1.5)))}
        deg = [0] * n
        for u, v in edges:
            deg[u] += 1
            deg[v] += 1

        def walk(state, k):  # k unit moves from state: (the moves, the end state)
            moves, cur = [], list(state)
            for _ in range(20 * k):
                if len(moves) == k:
                    break
                i, j = rng.sample(range(n), 2)
                if cur[i] < cur[j] and rng.random() < 0.8:
                    i, j = j, i
                if cur[j] > 0 and cur[i] < n - 1:
                    cur[i] += 1
                    cur[j] -= 1
                    moves.append((i, j))
            return moves, cur

        def after(state, moves):
            cur = list(state)
            for i, j in moves:
                cur[i] += 1
                cur[j] -= 1
            return cur
        pair, chunk = None, 1
        for _ in range(40):  # chunks of doubling length until one ends past the boundary; then bisected to one step
            moves, end = walk(deg, chunk)
            if not moves:
                break
            if _graphical(end):
                deg, chunk = end, chunk * 2
                continue
            lo, hi = 0, len(moves)  # after lo moves graphical, after hi not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if _graphical(after(deg, moves[:mid])) else (lo, mid)
            pair = after(deg, moves[:lo]), after(deg, moves[:hi])
            break
        if pair is not None:
            deg = pair[0] if want else pair[1]
        rng.shuffle(deg)
        return (f"Is there a simple undirected graph whose vertex degrees are exactly {fmt_list(deg, ', ')}? "
                f"Answer YES or NO.", "YES" if _graphical(deg) else "NO")

    def wrong_answers(self, problem):
        return ["NO" if problem.answer == "YES" else "YES", "MAYBE"]


@register("gym/bellman_ford")
class BellmanFord(IntAnswer):
    family, description = F, "Shortest path with negative arc weights (no negative cycles)."

    def build(self, rng, d):
        n = _n(d)
        pot = [rng.randint(0, 15 + d) for _ in range(n)]
        arcs = {}
        for i in range(n - 1):
            arcs[(i, i + 1)] = 0
        for _ in range(int(n * 1.5)):
            arcs[tuple(rng.sample(range(n), 2))] = 0
        perm = list(range(n))
        rng.shuffle(perm)
        el = [(perm[u], perm[v], rng.randint(0, 8 + d) + pot[u] - pot[v]) for (u, v) in arcs]
        dist = [None] * n
        dist[perm[0]] = 0
        for _ in range(n):
            changed = False
            for u, v, w in el:
                if dist[u] is not None and (dist[v] is None or dist[u] + w < dist[v]):
                    dist[v] = dist[u] + w
                    changed = True
            if not changed:  # a pass without a change: every later one is the same
                break
        rng.shuffle(el)
        return (f"{_wgraph_text(n, el, True)}\nWeights may be negative but there is no negative cycle. What is the "
                f"length of the shortest path from {perm[0]} to {perm[n - 1]}?", dist[perm[n - 1]])
