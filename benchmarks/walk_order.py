"""Why a kNN walk between clustered points costs more: the walk's order, measured.

    python benchmarks/walk_order.py --pending [--data clustered uniform]

replays, for a sample of queries on kdeqx's own tree (the same leaf boxes the query
walks), in NumPy, the engine's walk (`kdeqx._engine._traverse`: far children left
pending as one bit per level, the deepest pending one entered next) beside the walk
it replaced, which climbed back up through each parent (`climbing_walk`, 16 moves
per leaf visit): leaves visited, moves, and outer iterations (one leaf visit, then up
to a cap of moves) at several caps.

    python benchmarks/walk_order.py [--n 1e6] [--queries 300] [--k 8]
        [--data uniform clustered surface] [--timing]

counts, per query, how many leaves any exact walk must visit (those whose box lies
nearer than the final k-th distance), how many the climbing walk visits and how many
outer iterations it takes, and the same for a best-first order (a priority queue of
subtrees on box distance: the minimum of leaves) and for the climbing walk given the
exact k-th distance in advance. `--timing` then times, on 1,024 lanes, `CPU_STEPS`
moves of the engine against one leaf visit (the k-best merge included) and against
`CPU_STEPS` steps that also keep a priority queue of `S` entries per lane (push the
far child, pop the nearest entry), the extra work a best-first walk needs.

    python benchmarks/walk_order.py --orders [--data clustered uniform]

counts the same for walks in other orders over the same tree: the subtrees that the
descent to the first leaf passed by (one per level), walked nearest first or deepest
first, each near child first and left for the next without climbing back; and a
best-first order over the subtrees at depth 8 or 10 (the nearest one left next).
"Switch free" lets a lane take any number of subtrees between two leaf visits; "one
switch" lets it take one, a second waiting for the next visit.

    python benchmarks/walk_order.py --seeds [--data clustered uniform]

counts instead what a better first bound on the k-th distance would save: the climbing
walk from the same nearest leaf, with the bound taken from the query's predecessors
along the Morton curve (their final k-th distance plus their separation, by the
triangle inequality), from one more leaf (chosen by the boxes' largest distance, or an
oracle's: the leaf of the true nearest neighbour), from an eps-approximate first pass,
or the exact k-th distance.
"""

import argparse
import heapq
import time

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import scipy.spatial
from knn_k import points_and_queries

import kdeqx
from kdeqx._backend import CPU_STEPS, gather_clamped, lexicographic_less
from kdeqx._engine._metric import EUCLIDEAN
from kdeqx._engine._traverse import _Steps, morton_codes
from kdeqx._query._knn import _KNearest


def walked_tree(points):
    """kdeqx's tree over `points` as a query for k <= 16 neighbours walks it: the
    default tree's leaves split in halves, leaves of 16 (the tables in RESULTS.md
    before 2026-12-05 ~07:20 UTC replayed the leaves of 32)."""
    return kdeqx.KDTree(points.astype(np.float32))._halves_as_leaves()


class Boxes:
    """The tree's leaf slots and node boxes as NumPy, in its search coordinates."""

    def __init__(self, tree):
        self.lo = np.asarray(tree.node_lo, np.float64).T
        self.hi = np.asarray(tree.node_hi, np.float64).T
        self.points = np.asarray(tree.leaf_points, np.float64)
        self.indices = np.asarray(tree.leaf_indices)
        self.first_leaf = tree.num_leaves - 1
        self.leaf_size, self.n = tree.leaf_size, tree.n
        self.scale = float(tree.scale)

    def box_d2(self, q, node):
        gap = np.maximum(self.lo[node] - q, 0) + np.maximum(q - self.hi[node], 0)
        return float(gap @ gap)

    def leaf_d2(self, q, node):
        start = (node - self.first_leaf) * self.leaf_size
        rows = slice(start, start + self.leaf_size)
        d2 = np.sum((self.points[rows] - q) ** 2, axis=1)
        return np.where(self.indices[rows] < self.n, d2, np.inf)

    def children(self, q, node):
        """`(near, far, near_d2, far_d2)`, the left child near on a tie."""
        left, right = 2 * node + 1, 2 * node + 2
        d2_left, d2_right = self.box_d2(q, left), self.box_d2(q, right)
        if d2_left <= d2_right:
            return left, right, d2_left, d2_right
        return right, left, d2_right, d2_left

    def nearest_leaf(self, q):
        node = 0
        while node < self.first_leaf:
            node = self.children(q, node)[0]
        return node


def following(previous, parent, near, far, visit_near, visit_far):
    """The engine's move from a node: where the walk goes after it, given where it
    came from."""
    if previous == parent:
        return near if visit_near else far if visit_far else parent
    if previous == near:
        return far if visit_far else parent
    return parent


# The climbing walk's moves per leaf visit.
CLIMBING_STEPS = 16


def climbing_walk(boxes, q, k, bound=np.inf, factor=1.0):
    """The engine's walk until 2026-12-05: near child first from the nearest leaf,
    climbing back through each parent: `(outer iterations, leaves visited, k-th
    squared distance, moves)`. `factor > 1` prunes as scipy's `eps` does, with
    `factor = (1 + eps)**2`."""
    best = np.full(k, bound)
    node, previous = boxes.nearest_leaf(q), None
    iterations = leaves = moves = 0
    while node >= 0:
        iterations += 1
        if node >= boxes.first_leaf:
            best = np.sort(np.concatenate([best, boxes.leaf_d2(q, node)]))[:k]
            leaves += 1
            previous, node = node, (node - 1) >> 1
        for _ in range(CLIMBING_STEPS):
            if node < 0 or node >= boxes.first_leaf:
                break
            moves += 1
            parent = (node - 1) >> 1
            near, far, near_d2, far_d2 = boxes.children(q, node)
            visit = (near_d2 * factor < best[-1], far_d2 * factor < best[-1])
            previous, node = node, following(previous, parent, near, far, *visit)
    return iterations, leaves, best[-1], moves


def best_first_walk(boxes, q, k):
    """Descend to near children, queue the far ones, then pop the nearest queued
    subtree: `(outer iterations, leaves visited)` with the engine's step cap."""
    best = np.full(k, np.inf)
    # As the engine, it starts at the nearest leaf (found for all queries at once),
    # with the far children on the way there queued.
    queue, node = [], 0
    while node < boxes.first_leaf:
        near, far, _, far_d2 = boxes.children(q, node)
        heapq.heappush(queue, (far_d2, far))
        node = near
    iterations = leaves = 0
    while True:
        iterations += 1
        if node is not None and node >= boxes.first_leaf:
            best = np.sort(np.concatenate([best, boxes.leaf_d2(q, node)]))[:k]
            leaves += 1
            node = None
        for _ in range(CLIMBING_STEPS):
            if node is None:
                while queue and queue[0][0] >= best[-1]:
                    heapq.heappop(queue)
                if not queue:
                    return iterations, leaves
                node = heapq.heappop(queue)[1]
            if node >= boxes.first_leaf:
                break
            near, far, near_d2, far_d2 = boxes.children(q, node)
            if far_d2 < best[-1]:
                heapq.heappush(queue, (far_d2, far))
            node = near if near_d2 < best[-1] else None


def leaves_needed(boxes, q, kth_d2):
    leaves = np.arange(boxes.first_leaf, 2 * boxes.first_leaf + 1)
    gap = np.maximum(boxes.lo[leaves] - q, 0) + np.maximum(q - boxes.hi[leaves], 0)
    return int(np.sum(np.sum(gap**2, axis=1) < kth_d2))


def level_of(node):
    return int(node + 1).bit_length() - 1


def pending_walk(boxes, q, k, cap):
    """The engine's walk (`kdeqx._engine._traverse`) from the nearest leaf: `(outer
    iterations, leaves visited, moves, k-th squared distance)` with `cap` moves per
    leaf visit. A far child is left pending if worth a visit when passed (every one
    on the first descent); a pending subtree is entered without a new test (its
    children are tested on the way down), and a pending leaf is tested in the next
    move, if one is left before the visit."""
    best = np.full(k, np.inf)
    node, pending = 0, 0
    while node < boxes.first_leaf:  # all queries at once, before the lanes walk
        near, _, _, _ = boxes.children(q, node)
        pending |= 1 << level_of(near)
        node = near

    def resume(node):
        nonlocal pending
        below = pending & ((2 << level_of(node)) - 1)
        if below == 0:
            return -1
        deepest = below.bit_length() - 1
        pending = below & ((1 << deepest) - 1)
        on_path = ((int(node) + 1) >> (level_of(node) - deepest)) - 1
        return ((on_path + 1) ^ 1) - 1

    iterations = leaves = moves = 0
    tested = True  # a leaf reached by going down was tested by its parent's move
    while node >= 0:
        iterations += 1
        if node >= boxes.first_leaf:
            best = np.sort(np.concatenate([best, boxes.leaf_d2(q, node)]))[:k]
            leaves += 1
            node, tested = resume(node), False
        for _ in range(cap):
            if node < 0:
                break
            if node >= boxes.first_leaf:
                if tested:
                    break
                moves += 1
                if boxes.box_d2(q, node) < best[-1]:
                    tested = True
                    break
                node = resume(node)
                continue
            moves += 1
            near, _, near_d2, far_d2 = boxes.children(q, node)
            bit = 1 << level_of(near)
            pending = pending | bit if far_d2 < best[-1] else pending & ~bit
            if near_d2 < best[-1]:
                node, tested = near, True
            else:
                node, tested = resume(near), False
    return iterations, leaves, moves, best[-1]


PENDING_CAPS = (6, 8, 12, 16)


def pending(data, n, queries, k):
    """The engine's walk beside the climbing walk (see the module's docstring);
    every answer checked against the climbing walk's."""
    points, x = points_and_queries(data, n, queries, 3)
    boxes = Boxes(walked_tree(points))
    rows = []
    for q in x.astype(np.float32).astype(np.float64) * float(boxes.scale):
        iterations, leaves, kth_d2, moves = climbing_walk(boxes, q, k)
        row = [leaves, moves, iterations]
        for cap in PENDING_CAPS:
            walked = pending_walk(boxes, q, k, cap)
            assert walked[3] == kth_d2, "the pending walk lost a neighbour"
            row += (
                [walked[0]] if cap != CPU_STEPS else [walked[1], walked[2], walked[0]]
            )
        rows.append(row)
    mean = np.array(rows, float).mean(axis=0)
    print(f"{data:>10} " + " ".join(f"{v:>7.1f}" for v in mean))


def count(data, n, queries, k):
    points, x = points_and_queries(data, n, queries, 3)
    tree = walked_tree(points)
    boxes = Boxes(tree)
    rows = []
    for q in x.astype(np.float32).astype(np.float64) * float(tree.scale):
        iterations, leaves, kth_d2, _ = climbing_walk(boxes, q, k)
        given, given_leaves, *_ = climbing_walk(boxes, q, k, bound=kth_d2 * (1 + 1e-12))
        rows.append(
            (
                leaves_needed(boxes, q, kth_d2),
                leaves,
                iterations,
                *best_first_walk(boxes, q, k)[::-1],
                given_leaves,
                given,
            )
        )
    rows = np.array(rows, float)
    mean, p90 = rows.mean(axis=0), np.percentile(rows, 90, axis=0)
    cells = " ".join(f"{m:>6.2f} ({p:>3.0f})" for m, p in zip(mean, p90))
    print(f"{data:>10} {cells}")


class _Iterations:
    """Counts a walk's outer iterations: a leaf visit, then up to `CLIMBING_STEPS`
    moves; `switches` subtrees taken between two visits (the next waits for one
    more)."""

    def __init__(self, switches=None):
        self.count, self.moves_left, self.switches = 0, 0, switches
        self.leaves = self.taken = 0

    def visit(self):
        self.count, self.moves_left, self.taken = self.count + 1, CLIMBING_STEPS, 0
        self.leaves += 1

    def move(self):
        if self.moves_left == 0:
            self.count, self.moves_left, self.taken = self.count + 1, CLIMBING_STEPS, 0
        self.moves_left -= 1

    def switch(self):
        if self.switches is not None and self.taken >= self.switches:
            self.count, self.moves_left, self.taken = self.count + 1, CLIMBING_STEPS, 0
        self.taken += 1


def walk_subtree(boxes, q, best, root, counter, leaf=None):
    """The engine's walk within subtree `root`, from its `leaf` (visited already) or
    entered from above; it ends where it would climb out. Returns the k best."""
    if leaf is None:
        node, previous = root, (root - 1) >> 1
    else:
        node, previous = (leaf - 1) >> 1, leaf
        if leaf == root:
            return best
    while True:
        if node >= boxes.first_leaf:
            counter.visit()
            best = np.sort(np.concatenate([best, boxes.leaf_d2(q, node)]))[: len(best)]
            if node == root:
                return best
            previous, node = node, (node - 1) >> 1
            continue
        counter.move()
        parent = (node - 1) >> 1
        near, far, near_d2, far_d2 = boxes.children(q, node)
        visit = (near_d2 < best[-1], far_d2 < best[-1])
        after = following(previous, parent, near, far, *visit)
        if node == root and after == parent:
            return best
        previous, node = node, after


def passed_by_walk(boxes, q, k, nearest_first=True, switches=None):
    """The first leaf, then the subtrees its descent passed by, in order of box
    distance (or deepest first): `(outer iterations, leaves visited, k-th d2)`."""
    node, passed = 0, []
    while node < boxes.first_leaf:
        near, far, _, far_d2 = boxes.children(q, node)
        passed.append((far_d2, far))
        node = near
    counter = _Iterations(switches)
    counter.visit()
    best = np.sort(boxes.leaf_d2(q, node))[:k]
    passed = sorted(passed) if nearest_first else passed[::-1]
    for d2, root in passed:
        if d2 < best[-1]:
            counter.switch()
            best = walk_subtree(boxes, q, best, root, counter)
    return counter.count, counter.leaves, best[-1]


def best_first_below(boxes, q, k, depth):
    """Best-first over the subtrees at `depth` (the nearest one left next, the first
    from the first leaf), each walked near child first; switches free."""
    roots = np.arange(2**depth - 1, 2 ** (depth + 1) - 1)
    gap = np.maximum(boxes.lo[roots] - q, 0) + np.maximum(q - boxes.hi[roots], 0)
    d2 = np.sum(gap**2, axis=1)
    leaf = boxes.nearest_leaf(q)
    first = ((leaf + 1) >> (boxes.first_leaf.bit_length() - depth)) - 1
    counter = _Iterations()
    counter.visit()
    best = np.sort(boxes.leaf_d2(q, leaf))[:k]
    best = walk_subtree(boxes, q, best, first, counter, leaf=leaf)
    for j in np.argsort(d2, kind="stable"):
        if roots[j] != first and d2[j] < best[-1]:
            best = walk_subtree(boxes, q, best, roots[j], counter)
    return counter.count, counter.leaves, best[-1]


def orders(data, n, queries, k):
    """Leaves and outer iterations per query of the walks in other orders (see the
    module's docstring); every answer checked against the engine's."""
    points, x = points_and_queries(data, n, queries, 3)
    boxes = Boxes(walked_tree(points))
    rows = []
    for q in x.astype(np.float32).astype(np.float64) * float(boxes.scale):
        engine = climbing_walk(boxes, q, k)
        walks = [
            passed_by_walk(boxes, q, k),
            passed_by_walk(boxes, q, k, switches=1),
            passed_by_walk(boxes, q, k, nearest_first=False),
            best_first_below(boxes, q, k, 8),
            best_first_below(boxes, q, k, 10),
        ]
        assert all(w[2] == engine[2] for w in walks), "a walk lost a neighbour"
        rows.append([v for w in [engine, *walks] for v in w[1::-1]])
    mean = np.array(rows, float).mean(axis=0)
    print(f"{data:>10} " + " ".join(f"{v:>6.2f}" for v in mean))


def leaf_by_largest_distance(boxes, q):
    """The leaf that a descent to the child with the nearer far corner reaches."""
    node = 0
    while node < boxes.first_leaf:
        left, right = 2 * node + 1, 2 * node + 2
        largest = [
            np.sum(np.maximum(np.abs(boxes.lo[c] - q), np.abs(boxes.hi[c] - q)) ** 2)
            for c in (left, right)
        ]
        node = left if largest[0] <= largest[1] else right
    return node


def seeds(data, n, queries, k, q_all=100_000):
    """Leaves and outer iterations per query of the engine's walk with the bound
    seeded in several ways (see the module's docstring); `queries` of `q_all`
    Morton-sorted queries, from the 65th on."""
    points, x = points_and_queries(data, n, q_all, 3)
    tree = walked_tree(points)
    boxes = Boxes(tree)
    xs = x.astype(np.float32).astype(np.float64) * float(tree.scale)
    codes = morton_codes(
        jnp.asarray(xs, jnp.float32), tree.node_lo[:, 0], tree.node_hi[:, 0]
    )
    xs = xs[np.argsort(np.asarray(codes), kind="stable")]
    real = boxes.indices < boxes.n
    exact = scipy.spatial.cKDTree(boxes.points[real])
    kth = exact.query(xs, k)[0][:, -1]
    slots = np.nonzero(real)[0]
    rng = np.random.default_rng(1)
    rows = []
    for p in rng.choice(np.arange(64, len(xs)), queries, replace=False):
        q = xs[p]

        def from_predecessors(*back):
            return min((kth[p - j] + np.linalg.norm(q - xs[p - j])) ** 2 for j in back)

        def from_leaf(leaf):
            return np.sort(boxes.leaf_d2(q, leaf))[k - 1]

        nearest_slot = slots[exact.query(q, 1)[1]]
        oracle = boxes.first_leaf + nearest_slot // boxes.leaf_size
        row = list(climbing_walk(boxes, q, k)[1::-1])
        bounds = [
            from_predecessors(1),
            from_predecessors(1, 2, 3, 4),
            from_predecessors(16),
            from_predecessors(64),
            from_leaf(leaf_by_largest_distance(boxes, q)),
            from_leaf(oracle),
        ]
        for bound in bounds:  # the one extra leaf visit of the leaf seeds not counted
            row += climbing_walk(boxes, q, k, bound=bound * (1 + 1e-6))[1::-1]
        for eps in (0.25, 1.0, 4.0):
            first_it, first_lv, first_kth, _ = climbing_walk(
                boxes, q, k, factor=(1 + eps) ** 2
            )
            it, lv, *_ = climbing_walk(boxes, q, k, bound=first_kth * (1 + 1e-6))
            row += [first_lv + lv, first_it + it]
        row += climbing_walk(boxes, q, k, bound=kth[p] ** 2 * (1 + 1e-9))[1::-1]
        rows.append(row)
    mean = np.array(rows, float).mean(axis=0)
    print(f"{data:>10} " + " ".join(f"{v:>6.1f}" for v in mean))


def timing(k, sizes, repeats=5, rounds=200):
    points, x = points_and_queries("uniform", 1_000_000, 1024, 3)
    tree = walked_tree(points)
    steps = _Steps(tree, EUCLIDEAN)
    x = jax.vmap(steps.search_point)(jnp.asarray(x, jnp.float32))
    index_dtype = tree.leaf_indices.dtype
    visitor = _KNearest(k, jnp.float32(jnp.inf), index_dtype)
    # A k-th distance that prunes like a real walk's (about a leaf's spacing).
    state = (
        jnp.full((1024, k), 1e-3, jnp.float32),
        jnp.full((1024, k), 5, index_dtype),
    )
    rng = np.random.default_rng(1)
    internal = jnp.asarray(rng.integers(0, steps.first_leaf, 1024), index_dtype)
    leaves = internal + steps.first_leaf
    move = jax.vmap(steps.move, in_axes=(0, None, 0, 0, 0))
    visit = jax.vmap(steps.visit, in_axes=(0, None, 0, 0, 0))
    children = jax.vmap(steps.children)
    no_pending = jnp.zeros(1024, index_dtype)

    @jax.jit
    def moves(x, state, start):
        def body(_, carry):
            cursor, pending = move(x, visitor, state, *carry)
            walking = steps.is_internal(cursor >> 2)
            return jnp.where(walking, cursor, start << 2), pending

        return lax.fori_loop(0, rounds * CPU_STEPS, body, (start << 2, no_pending))

    @jax.jit
    def visits(x, state, leaf):
        return lax.fori_loop(
            0,
            rounds,
            lambda _, s: visit(x, visitor, s, leaf << 2, no_pending)[0],
            state,
        )

    def queue_steps(size):
        keys = steps.node_keys

        def one_step(x, state, node, queue):
            """Descend to the near child and queue the far one; lanes at a leaf or
            with a pruned near child pop the nearest queued subtree."""
            d2, key, queued = queue
            kth_d2, kth_index = state[0][:, -1:], state[1][:, -1:]
            near, far, near_d2, far_d2 = children(x, node)
            visit_near = lexicographic_less(
                near_d2, gather_clamped(keys, near), kth_d2[:, 0], kth_index[:, 0]
            )
            visit_far = lexicographic_less(
                far_d2, gather_clamped(keys, far), kth_d2[:, 0], kth_index[:, 0]
            )
            free = d2 == jnp.inf
            slot = jnp.arange(size) == jnp.argmax(free, axis=1)[:, None]
            slot &= (visit_far & jnp.any(free, axis=1))[:, None]
            d2 = jnp.where(slot, far_d2[:, None], d2)
            key = jnp.where(slot, gather_clamped(keys, far)[:, None], key)
            queued = jnp.where(slot, far[:, None], queued)
            d2 = jnp.where(lexicographic_less(d2, key, kth_d2, kth_index), d2, jnp.inf)
            pick = jnp.arange(size) == jnp.argmin(d2, axis=1)[:, None]
            popped = jnp.sum(jnp.where(pick, queued, 0), axis=1)
            pop = ~visit_near | (node >= steps.first_leaf)
            d2 = jnp.where(pick & pop[:, None], jnp.inf, d2)
            return jnp.where(pop, popped, near), (d2, key, queued)

        @jax.jit
        def run(x, state, start):
            queue = (
                jnp.where(jnp.arange(size) < size // 2, 1e-6, jnp.inf)
                * jnp.ones((1024, 1), jnp.float32),
                jnp.zeros((1024, size), index_dtype),
                jnp.broadcast_to(start[:, None], (1024, size)),
            )

            def body(_, carry):
                node, queue = one_step(x, state, *carry)
                return jnp.where(node >= steps.first_leaf, start, node), queue

            return lax.fori_loop(0, rounds * CPU_STEPS, body, (start, queue))

        return run

    def best_ms(fn, start):
        jax.block_until_ready(fn(x, state, start))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(x, state, start))
            times.append(time.perf_counter() - t)
        return min(times) / rounds * 1e3

    print(f"\nPer outer iteration of 1,024 lanes (k = {k}), best of {repeats}:")
    print(f"  {CPU_STEPS} engine moves: {best_ms(moves, internal):.3f} ms")
    print(f"  one leaf visit (k-best merge): {best_ms(visits, leaves):.3f} ms")
    for size in sizes:
        ms = best_ms(queue_steps(size), internal)
        print(f"  {CPU_STEPS} steps with a queue of {size}: {ms:.3f} ms")
    print(f"  {CPU_STEPS} engine moves, again: {best_ms(moves, internal):.3f} ms")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=float, default=1e6)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument(
        "--data", nargs="+", default=["uniform", "clustered", "surface"]
    )
    parser.add_argument("--timing", action="store_true")
    parser.add_argument("--queue-sizes", type=int, nargs="+", default=[8, 24])
    parser.add_argument("--seeds", action="store_true")
    parser.add_argument("--orders", action="store_true")
    parser.add_argument("--pending", action="store_true")
    args = parser.parse_args()
    if args.pending:
        caps = " ".join(f"cap {c}" for c in PENDING_CAPS)
        header = (
            f"n = {args.n:.0e}, {args.queries} uniform queries per data set, "
            f"k = {args.k}, leaves of 16 (the halves); means per query of: the "
            f"climbing walk's leaves, moves, iterations (cap {CLIMBING_STEPS}) | the "
            f"engine's iterations at {caps}, with its leaves and moves before the "
            f"iterations at cap {CPU_STEPS}"
        )
    elif args.orders:
        header = (
            f"n = {args.n:.0e}, {args.queries} uniform queries per data set, "
            f"k = {args.k}, leaves of 16 (the halves); leaves and outer iterations "
            f"per query (mean) of: the climbing walk | the subtrees passed by, nearest "
            f"first, switch free | the same, one switch | deepest first, switch "
            f"free | best-first below depth 8 | below depth 10"
        )
    elif args.seeds:
        header = (
            f"n = {args.n:.0e}, {args.queries} of 1e5 uniform queries per data set, "
            f"k = {args.k}; leaves and outer iterations per query (mean), the "
            f"climbing walk with its bound seeded by: none | predecessor 1 | best "
            f"of 1-4 | 16th | 64th | a leaf by largest distance | the nearest "
            f"neighbour's leaf | "
            f"eps 0.25, 1, 4 first passes (both passes) | the exact k-th distance"
        )
    else:
        header = (
            f"n = {args.n:.0e}, {args.queries} uniform queries per data set, "
            f"k = {args.k}, leaves of 16 (the halves); mean (p90) per query.\n"
            f"{'data':>10} {'needed':>12} {'climb lv':>12} {'climb it':>12} "
            f"{'b-first lv':>12} {'b-first it':>12} {'given lv':>12} {'given it':>12}"
        )
    print(header)
    for data in args.data:
        walks = (
            pending
            if args.pending
            else orders
            if args.orders
            else seeds
            if args.seeds
            else count
        )
        walks(data, int(args.n), args.queries, args.k)
    if args.timing:
        timing(args.k, args.queue_sizes)


if __name__ == "__main__":
    main()
