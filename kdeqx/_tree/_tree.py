"""The tree interface every tree type shares, and `KDTree`, the tree on one device.

`AbstractKDTree` holds each public query method once: its signature, its docstring and
the validation of its arguments. A tree type only answers validated queries, through
the private `_knn`, `_count`, `_collect` and `_knn_rows` methods.
"""

import abc
import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

import equinox as eqx
import jax
import jax.experimental.sparse
import jax.numpy as jnp
import numpy as np

from .._backend import outside_any_trace
from .._backend._buckets import bucket, pad_rows, queries_in_buckets
from .._backend._mesh import split_like_queries
from .._custom_types import (
    Array,
    ArrayLike,
    Ball,
    Float,
    Int,
    Neighbours,
    Queries,
    Threshold,
)
from .._engine._base import AbstractSearchTree
from .._engine._metric import check_norm, Minkowski
from .._engine._search import rows_at
from .._interpolation import _interpolate, _kernels, _rbf
from .._interpolation._local import AbstractLocalFit, interpolate_locally
from .._query import _knn, _pairs as _pairs_module, _radius
from .._validate import (
    as_float_array,
    as_period,
    check_finite,
    check_points_shape,
    check_queries_shape,
    check_radii,
    check_radius,
    check_scalar_radius,
    check_static_int,
    check_values,
    check_weights,
    is_concrete,
)
from ._build import build_bucket, build_search_arrays, sentinels_moved


class AbstractKDTree(eqx.Module):
    """The interface of every k-d tree in kdeqx: scipy's `cKDTree` queries, exact,
    with JAX's fixed shapes.

    `kdeqx.KDTree` (one device) and `kdeqx.ShardedKDTree` (one tree per device) are its
    implementations; anything that accepts a tree (such as `kdeqx.Interpolator`)
    accepts either.

    Conventions, for every method: queries `x` have shape `(d,)` or `(..., d)` and
    must be finite; results keep the batch shape `...`; missing neighbours are
    distance `inf` and index `n` (scipy's convention); equal distances are ordered by
    the lower index. Distances and interpolated values are differentiable with
    respect to `x`, the points and `values` (the neighbour *choice* is piecewise
    constant and carries no gradient).
    """

    # Whether the query methods check traced inputs for NaN/inf themselves; a tree
    # type may leave that to where they are used (on each device, for a sharded tree).
    checks_traced_inputs: eqx.AbstractClassVar[bool]
    # Periodic box lengths `(d,)` (`<= 0`: an open axis), or `None` (scipy's boxsize).
    period: eqx.AbstractVar[Float[Array, " d"] | None]

    @property
    @abc.abstractmethod
    def n(self) -> int:
        """Number of points."""

    @property
    @abc.abstractmethod
    def d(self) -> int:
        """Dimension of the points."""

    @property
    @abc.abstractmethod
    def dtype(self) -> jnp.dtype:
        """The points' floating dtype, in which queries are answered."""

    @queries_in_buckets("distance_upper_bound", points_in_bucket=True)
    def query(
        self,
        x: ArrayLike,
        k: int | Sequence[int] = 1,
        *,
        eps: float | ArrayLike = 0.0,
        p: int | float = 2.0,
        distance_upper_bound: float | ArrayLike = jnp.inf,
        workers: int | None = None,
    ) -> tuple[Float[Array, "*batch k"], Int[Array, "*batch k"]]:
        """Finds the `k` nearest points to each query.

        Semantics follow `scipy.spatial.cKDTree.query`, with two deliberate choices:
        the trailing `k` axis is always present, and equal distances are ordered by
        the lower index (scipy leaves the order of ties unspecified).

        **Arguments:**

        - `x`: queries, shape `(d,)` or `(..., d)`. Must be finite.
        - `k`: number of neighbours, a static Python int `>= 1`, or a sequence of
            ranks counted from 1, as scipy's (`k=[1, 3, 8]`: the nearest, the third
            and the eighth; `k=n` is `k=range(1, n + 1)`). `k > n` is allowed and
            costs what `k = n` costs: the neighbours beyond `n` are sentinels.
        - `eps`: approximate search, `>= 0`, as scipy's: the `j`-th neighbour
            returned is at most `(1 + eps)` times as far as the true `j`-th nearest
            point. Subtrees farther than the current `k`-th distance over `1 + eps`
            are skipped, so `eps > 0` visits fewer leaves. `0` (default) is exact.
        - `p`: the Minkowski norm, a static Python number `1 <= p <= inf`
            (`(sum_j |x_j - y_j|**p)**(1/p)`, `max_j |x_j - y_j|` for `inf`); `1`,
            `2` (default) and `inf` take the fastest paths. For `p` other than `1`
            and `inf` the search compares sums of `p`-th powers, as scipy does, whose
            range narrows with `p`: in float32 a difference below about
            `2**(-126/p)` times the data's extent (`2**-63` for `p = 2`; an extent
            of one for points that all coincide) counts as 0.
        - `distance_upper_bound`: only points at distance strictly less than this are
            returned (a scalar, or one value per query of shape `(...)`).
        - `workers`: scipy's, accepted so that ported scripts run; it changes
            nothing. kdeqx uses the threads and devices JAX has (on a CPU, one
            device per core with `kdeqx.use_every_core`).

        **Returns:**

        `(distances, indices)`, each of shape `(..., k)` (`(..., len(k))` for a
        sequence), sorted by distance (ties by index). `indices` are rows of the
        points. Missing neighbours (fewer than `k` points, or none within
        `distance_upper_bound`) are distance `inf` and index `n`. `distances` are
        differentiable with respect to `x` and the points.
        """
        check_workers(workers)
        ranks = check_ranks(k)
        k = max(ranks)
        metric = check_norm(p, eps)
        x = self._check_queries(x)
        bound = jnp.asarray(distance_upper_bound, x.dtype)
        if bound.ndim > 0:
            bound = _broadcast_to_batch("distance_upper_bound", bound, x.shape[:-1])
        found = self._knn(x, bound, _findable(k, self.n), metric)
        distances, indices = _padded(found, k, self.n)
        if ranks == tuple(range(1, k + 1)):
            return distances, indices
        columns = jnp.asarray(ranks) - 1
        return distances[..., columns], indices[..., columns]

    @queries_in_buckets("r", points_in_bucket=True)
    def count_ball_point(
        self,
        x: ArrayLike,
        r: float | ArrayLike,
        *,
        p: int | float = 2.0,
        eps: float | ArrayLike = 0.0,
    ) -> Int[Array, "*batch"]:
        """Counts the points within distance `r` (inclusive) of each query.

        The same numbers as `scipy.spatial.cKDTree.query_ball_point(x, r, p, eps,
        return_length=True)`, in `O(Q)` memory: nothing of size `Q x n` is formed.

        **Arguments:**

        - `x`: queries, shape `(d,)` or `(..., d)`.
        - `r`: radius, a scalar or one per query (shape `(...)`); finite and `>= 0`.
        - `p`: the Minkowski norm, as in `query`.
        - `eps`: approximate search, `>= 0`, as scipy's: subtrees whose nearest point
            is farther than `r / (1 + eps)` are skipped, and the points met within
            `r (1 + eps)` count, so the count lies between the exact counts for
            `r / (1 + eps)` and `r (1 + eps)`. `0` (default) is exact.

        **Returns:**

        Integer counts of shape `(...)`.
        """
        metric = check_norm(p, eps)
        x = self._check_queries(x)
        return self._count(x, check_radius(r, x.shape[:-1], x.dtype), metric)

    @queries_in_buckets("r", points_in_bucket=True)
    def query_ball_point(
        self,
        x: ArrayLike,
        r: float | ArrayLike,
        max_neighbors: int | None = None,
        *,
        p: int | float = 2.0,
        eps: float | ArrayLike = 0.0,
        raise_on_overflow: bool = False,
        workers: int | None = None,
        return_sorted: bool | None = None,
        return_length: bool = False,
    ) -> (
        tuple[Float[Array, "*batch m"], Int[Array, "*batch m"], Int[Array, "*batch"]]
        | Int[Array, "*batch"]
    ):
        """Finds the points within distance `r` (inclusive) of each query.

        JAX needs fixed shapes, so at most `max_neighbors` are returned, nearest first
        (ties by lower index), and `counts` says how many there really are.

        **Arguments:**

        - `x`: queries, shape `(d,)` or `(..., d)`.
        - `r`: radius, a scalar or one per query (shape `(...)`); finite and `>= 0`.
        - `max_neighbors`: the fixed capacity `m`, a static Python int `>= 1`; or
            `None` (default) outside `jit`, `grad` and `vmap`: the points are
            counted first (`count_ball_point`) and `m` is the size bucket of the
            largest count (see `kdeqx.bucket`), so that nothing is cut off and
            nearby counts share one compiled program. Under a transformation the
            capacity fixes the answer's shape and must be given: count outside it
            (`m = int(tree.count_ball_point(x, r).max())`), or pass a generous one
            with `raise_on_overflow=True`.
        - `p`: the Minkowski norm, as in `query`.
        - `eps`: approximate search, as in `count_ball_point` (the points returned
            lie within `r (1 + eps)`, and include every point within
            `r / (1 + eps)`).
        - `raise_on_overflow`: if `True`, a query with more than `max_neighbors`
            points within `r` raises an error instead of truncating: eagerly a
            `ValueError` that names the capacity needed, under `jit` a runtime
            error (via `eqx.error_if`).
        - `workers`: scipy's, accepted; it changes nothing (see `query`).
        - `return_sorted`: `True` orders each query's points by index, as scipy's
            lists for a batch of queries; `None` (default) or `False`: nearest first
            (ties by lower index).
        - `return_length`: `True` returns only the counts, as scipy's
            (`count_ball_point`, which needs no capacity).

        **Returns:**

        `(distances, indices, counts)`: distances and indices of shape `(..., m)`,
        padded with `(inf, n)`; `counts` of shape `(...)` is the true number of points
        within `r`, so `counts > m` shows truncation. Distances are differentiable.
        `kdeqx.ball_lists(indices, counts)` gives scipy's lists.
        """
        check_workers(workers)
        if return_length:
            return self.count_ball_point(x, r, p=p, eps=eps)
        if return_sorted not in (None, True, False):
            raise TypeError(
                f"`return_sorted` must be a bool or None, got {return_sorted!r}."
            )
        metric = check_norm(p, eps)
        x = self._check_queries(x)
        r = check_radius(r, x.shape[:-1], x.dtype)
        max_neighbors = _capacity(
            max_neighbors,
            "max_neighbors",
            "query_ball_point",
            lambda: jnp.max(self._count(x, *_outer_reach(r, metric)), initial=0),
        )
        distances, indices, counts = self._collect(
            x, r, _findable(max_neighbors, self.n), metric
        )
        distances, indices = _padded((distances, indices), max_neighbors, self.n)
        distances, indices, counts = _checked_capacity(
            (distances, indices, counts),
            jnp.max(counts, initial=0),
            max_neighbors,
            "query_ball_point",
            "max_neighbors",
            raise_on_overflow,
        )
        if return_sorted:
            order = jnp.argsort(indices, axis=-1, stable=True)
            distances = jnp.take_along_axis(distances, order, -1)
            indices = jnp.take_along_axis(indices, order, -1)
        return distances, indices, counts

    @queries_in_buckets()
    def interpolate(
        self,
        x: ArrayLike,
        values: ArrayLike,
        *,
        k: int = 8,
        p: int | float = 2.0,
        kernel: _kernels.KernelName | _kernels.AbstractKernel = "idw",
        power: float = 2.0,
        length_scale: float | ArrayLike | None = None,
        rbf: _rbf.Radial = "thin_plate_spline",
        epsilon: float | ArrayLike | None = None,
        degree: int | None = None,
        smoothing: float | ArrayLike = 0.0,
        exact: bool = False,
    ) -> Float[Array, "..."]:
        """Interpolates `values` at `x` from the `k` nearest points.

        **Arguments:**

        - `x`: queries, shape `(d,)` or `(..., d)`.
        - `values`: the field at the points, shape `(n, ...)`, rows in the order of
            the points. Must be finite.
        - `k`: neighbours per query (static Python int `>= 1`; `k > n` uses all `n`).
        - `p`: the Minkowski norm of the distances, as in `query` (`"idw"` and
            `"gaussian"` only; the local fits are Euclidean).
        - `kernel`: how the neighbours' values are combined (see the guide
            "Choosing an interpolation kernel"): a kernel module
            ([`kdeqx.IDW`][], [`kdeqx.Gaussian`][], [`kdeqx.RBF`][],
            [`kdeqx.MLS`][]), which holds its own options, or its name, with the
            options as the keywords below:
            - `"idw"` (default): the mean weighted by `1/d**power`.
            - `"gaussian"`: the mean weighted by `exp(-d**2 / (2 length_scale**2))`.
            - `"rbf"`: scipy's `RBFInterpolator(points, values, neighbors=k,
                kernel=rbf, epsilon=epsilon, degree=degree, smoothing=smoothing)`,
                evaluated at `x`: each query solves the RBF interpolant (with
                polynomial terms) of its `k` nearest points. Exact at the points,
                most accurate; jumps where the set of neighbours changes.
            - `"mls"`: moving least squares of `degree` 0, 1 or 2 (default 1) with
                weights that vanish smoothly at a support radius that moves
                smoothly with `x`: the interpolant and its gradient are continuous.
        - `power`: inverse-distance exponent `> 0` (`"idw"`).
        - `length_scale`: the Gaussian kernel's width `> 0`, required for it.
        - `rbf`: the radial function of `"rbf"`: `"thin_plate_spline"` (default),
            `"cubic"`, `"quintic"`, `"linear"`, `"gaussian"`, `"multiquadric"`,
            `"inverse_multiquadric"` or `"inverse_quadratic"`, as in scipy.
        - `epsilon`: the shape parameter of `"rbf"` (`> 0`; scipy's default 1 for
            the scale-invariant kernels, required for the others).
        - `degree`: the polynomial degree, `>= -1` (`-1`: none), of `"rbf"` (scipy's
            default per kernel: 1 for the thin-plate spline and cubic, 2 for
            quintic, 0 otherwise; at most as many terms as neighbours); 0, 1 or 2 for
            `"mls"` (default 1).
        - `smoothing`: `"rbf"`'s smoothing, `>= 0`: a scalar or one value per point,
            shape `(n,)`, as scipy's (0, the default, interpolates).
        - `exact`: for `"mls"`, weights singular at the points, so that the
            interpolant reproduces the data there (to about `sqrt(eps)` relative to
            the neighbours' spread).

        **Returns:**

        The interpolated values, shape `(..., *values.shape[1:])`. Where a query
        coincides with data points, `"idw"` returns the mean of their values (finite,
        with finite gradients). A local system that is numerically singular
        (duplicate points with `smoothing=0`, or neighbours that cannot determine the
        polynomial, such as collinear points with `degree=1` in 2-D; scipy raises
        there) is solved with a ridge of `sqrt(eps)` times its largest entry:
        duplicates then share the mean of their values. Differentiable with respect
        to `x`, `values`, the points, and `length_scale`, `epsilon` and `smoothing`.
        """
        if self.n == 0:
            raise ValueError("Cannot interpolate from an empty tree (n = 0).")
        kernel = _kernels.as_kernel(
            kernel,
            power=power,
            length_scale=length_scale,
            rbf=rbf,
            epsilon=epsilon,
            degree=degree,
            smoothing=smoothing,
            exact=exact,
        )
        k, metric, method = self._interpolation_kernel(k, p, kernel)
        values = check_values(values, self.n)
        x = self._check_queries(x)
        if isinstance(method, AbstractLocalFit):
            return interpolate_locally(self, x, values, k, metric, method)
        distances, indices, rows = self._knn_rows(x, k, values, metric)
        return _interpolate.weighted_mean(method(distances, indices < self.n), rows)

    def _interpolation_kernel(
        self, k: int, p: int | float, kernel: _kernels.AbstractKernel
    ) -> tuple[int, Minkowski, _kernels.Weights | AbstractLocalFit]:
        """`(k, metric, method)` for `interpolate`: the neighbours a query gets, the
        norm, and the kernel with its options (those of `interpolate`) checked."""
        k = _findable(check_static_int("k", k, 1), self.n)
        metric = check_norm(p, 0.0)
        method = kernel.method(p=metric.p, k=k, n=self.n, d=self.d, dtype=self.dtype)
        return k, metric, method

    def query_ball_tree(
        self,
        other: "AbstractKDTree",
        r: float | ArrayLike,
        max_neighbors: int | None = None,
        *,
        p: int | float = 2.0,
        eps: float | ArrayLike = 0.0,
        raise_on_overflow: bool = False,
    ) -> tuple[Float[Array, "n m"], Int[Array, "n m"], Int[Array, " n"]]:
        """For each point of this tree, the points of `other` within distance `r`
        (scipy's `query_ball_tree`), in a fixed capacity.

        **Arguments:**

        - `other`: a tree of the same dimension (any tree type).
        - `r`, `max_neighbors`, `p`, `eps`, `raise_on_overflow`: as in
            `query_ball_point` (`r` a scalar, or one per point of this tree).

        **Returns:**

        `(distances, indices, counts)` as `other.query_ball_point(points)` returns
        them: one row per point of this tree, nearest first, padded with
        `(inf, other.n)`, and the true counts. Convert to scipy's lists of lists with
        `kdeqx.ball_lists(indices, counts)`.
        """
        self._check_other(other)
        return other.query_ball_point(
            self._points(),
            r,
            max_neighbors,
            p=p,
            eps=eps,
            raise_on_overflow=raise_on_overflow,
        )

    def query_pairs(
        self,
        r: float | ArrayLike,
        max_pairs: int | None = None,
        *,
        p: int | float = 2.0,
        eps: float | ArrayLike = 0.0,
        raise_on_overflow: bool = False,
        sort: bool = True,
        output_type: str | None = None,
    ) -> tuple[Int[Array, "max_pairs 2"], Float[Array, " max_pairs"], Int[Array, ""]]:
        """All pairs of points `i < j` at distance at most `r` (scipy's
        `query_pairs`), in a fixed capacity.

        **Arguments:**

        - `r`: the distance, a finite scalar `>= 0`.
        - `max_pairs`: the fixed capacity, a static Python int `>= 1`; or `None`
            (default) outside `jit`, `grad` and `vmap`: the pairs are counted first
            (`count_neighbors`) and the capacity is the size bucket of their number
            (see `query_ball_point`).
        - `p`: the Minkowski norm, as in `query`.
        - `eps`: approximate search, as in `count_ball_point`: every pair within
            `r / (1 + eps)` is found, and no pair beyond `r (1 + eps)`.
        - `raise_on_overflow`: if `True`, more than `max_pairs` pairs raise an error
            instead of being cut off (as in `query_ball_point`).
        - `sort`: a static bool. `True` orders the pairs by `i`, then `j`. `False`
            leaves them in the order the walk met them (the same for the same tree
            on the same backend, otherwise unspecified, like scipy's
            `output_type="ndarray"`), which spares the sort of `max_pairs` keys, a
            large share of this query's time on a CPU (see
            `benchmarks/scipy_api.py`). A `ShardedKDTree` sorts either way.
        - `output_type`: scipy's, refused: the answer is always arrays, which
            `kdeqx.pair_set` (scipy's `"set"`) and `kdeqx.pair_array` (`"ndarray"`)
            convert.

        **Returns:**

        `(pairs, distances, count)`: `pairs` of shape `(max_pairs, 2)`, each with
        `i < j`, ordered as `sort` says, padding `(n, n)` last; their distances
        (differentiable, `inf` at padding); and the true number of pairs, an integer
        scalar that may exceed `max_pairs`. On overflow the pairs kept are those the
        walk met first. `kdeqx.pair_set(pairs, count)` gives scipy's set of tuples.
        """
        refuse_output_type(
            output_type, "query_pairs", "`kdeqx.pair_set` or `kdeqx.pair_array`"
        )
        metric = check_norm(p, eps)
        r = check_scalar_radius("r", r, self.dtype)
        max_pairs = _capacity(
            max_pairs,
            "max_pairs",
            "query_pairs",
            lambda: (self._pair_count(*_outer_reach(r, metric)) - self.n) // 2,
        )
        if not isinstance(sort, bool):
            raise TypeError(f"`sort` must be a Python bool, got {sort!r}.")
        found = self._self_pairs(r, max_pairs, metric, sort)
        return _checked_capacity(
            (
                jnp.stack([found.rows, found.cols], axis=-1),
                found.distances,
                found.count,
            ),
            found.count,
            max_pairs,
            "query_pairs",
            "max_pairs",
            raise_on_overflow,
        )

    def sparse_distance_matrix(
        self,
        other: "AbstractKDTree",
        max_distance: float | ArrayLike,
        max_entries: int | None = None,
        *,
        p: int | float = 2.0,
        raise_on_overflow: bool = False,
        output_type: str | None = None,
    ) -> tuple[jax.experimental.sparse.BCOO, Int[Array, ""]]:
        """The distances between the points of this tree and those of `other` that
        are at most `max_distance` apart (scipy's `sparse_distance_matrix`), as a
        sparse matrix of fixed capacity.

        **Arguments:**

        - `other`: a tree of the same dimension (any tree type).
        - `max_distance`: a finite scalar `>= 0`.
        - `max_entries`: the fixed number of stored entries, a static Python int;
            or `None` (default) outside `jit`, `grad` and `vmap`: the pairs are
            counted first (`count_neighbors`) and the capacity is the size bucket
            of their number (see `query_ball_point`).
        - `p`: the Minkowski norm, as in `query`.
        - `raise_on_overflow`: as in `query_pairs`.
        - `output_type`: scipy's, refused: the answer is a BCOO matrix, which
            `kdeqx.to_scipy_sparse` (scipy's `"coo_matrix"`) and
            `kdeqx.distance_dict` (`"dict"`) convert.

        **Returns:**

        `(matrix, count)`: a `jax.experimental.sparse.BCOO` of shape
        `(n, other.n)` with `max_entries` stored entries, sorted by row then column
        (pairs at distance 0 are stored too, as explicit zeros; padding entries
        have the out-of-range index `(n, other.n)`, which BCOO ignores), and the true
        number of pairs. The data are differentiable. For scipy:
        `kdeqx.to_scipy_sparse(matrix)`.

        With `other` this very tree (scipy's idiom for one set's matrix), the pairs
        `i < j` are found once, by `query_pairs`' walk, then mirrored, and the
        diagonal added: much faster than a walk for every pair (see
        `benchmarks/scipy_api.py`).
        """
        refuse_output_type(
            output_type,
            "sparse_distance_matrix",
            "`kdeqx.to_scipy_sparse` or `kdeqx.distance_dict`",
        )
        self._check_other(other)
        metric = check_norm(p, 0.0)
        max_distance = check_scalar_radius("max_distance", max_distance, other.dtype)
        max_entries = _capacity(
            max_entries,
            "max_entries",
            "sparse_distance_matrix",
            lambda: self._pair_count(max_distance, metric, other),
        )
        if other is self:  # scipy's idiom for one set's matrix: its pairs, mirrored
            found = self._self_matrix(max_distance, max_entries, metric)
        else:
            found = other._pairs(
                self._points().astype(other.dtype),
                max_distance,
                max_entries,
                metric,
                False,
            )
        found = _checked_capacity(
            found,
            found.count,
            max_entries,
            "sparse_distance_matrix",
            "max_entries",
            raise_on_overflow,
        )
        distances = found.distances
        stored = found.rows < self.n
        matrix = jax.experimental.sparse.BCOO(
            (
                jnp.where(stored, distances, 0),
                jnp.stack([found.rows, found.cols], axis=-1),
            ),
            shape=(self.n, other.n),
            indices_sorted=True,
            unique_indices=True,
        )
        return matrix, found.count

    def count_neighbors(
        self,
        other: "AbstractKDTree",
        r: float | ArrayLike | Sequence[float],
        *,
        p: int | float = 2.0,
        weights: None | ArrayLike | tuple[ArrayLike | None, ArrayLike | None] = None,
        cumulative: bool = True,
    ) -> Array:
        """Counts the pairs `(x, y)`, `x` a point of this tree and `y` one of
        `other`, at distance at most `r` (scipy's `count_neighbors`, the two-point
        correlation's pair counts), for one radius or many at once.

        Each point of this tree walks `other` once for all radii, and the counts are
        summed as the walks finish: memory `O(n + m + len(r))`, no capacity.

        **Arguments:**

        - `other`: a tree of the same dimension (this tree itself for auto-pairs,
            which counts every `(i, i)` and both orders of each pair, as scipy).
        - `r`: a scalar or a 1-D array of radii, finite and `>= 0`.
        - `p`: the Minkowski norm, as in `query`.
        - `weights`: `None` (count pairs); a tuple `(weights_self, weights_other)`,
            either of which may be `None` (weight 1); or one array for both trees
            (when `other` is this tree), as scipy. A pair weighs the product of its
            two points' weights. Weights are finite, one per point.
        - `cumulative`: `True` (default) counts the pairs within each `r`; `False`
            counts those in each bin `r[k - 1] < d <= r[k]` (`r` must then be
            non-decreasing; the first bin starts at `-inf`).

        **Returns:**

        The counts, of the shape of `r`: integers without weights (int64 with x64
        enabled; int32 otherwise, with a runtime error where a count exceeds 2e9),
        floats with weights. Weighted counts are differentiable with respect to the
        weights.
        """
        self._check_other(other)
        metric = check_norm(p, 0.0)
        radii = check_radii(r, other.dtype, sorted_=not cumulative)
        self_weights, other_weights = _split_weights(weights, self, other)
        order = jnp.argsort(radii.ravel())
        counts = other._counts_within(
            self._points().astype(other.dtype),
            radii.ravel()[order],
            metric,
            self_weights,
            other_weights,
        )
        counts = jnp.empty_like(counts).at[order].set(counts)
        if not cumulative:
            counts = jnp.diff(counts, prepend=jnp.zeros_like(counts[:1]))
        return counts.reshape(radii.shape)

    def _in_build_bucket(self) -> "AbstractKDTree":
        """This tree as the same tree of its build bucket's number of points, whose
        eager queries share one program with every tree of that bucket (see
        `KDTree`); a tree type without buckets returns itself."""
        return self

    def _check_queries(self, x: ArrayLike) -> Queries:
        x = as_float_array("x", x, dtype=self.dtype)
        check_queries_shape("x", x, self.d)
        return check_finite("x", x, traced=self.checks_traced_inputs)

    # What a tree type implements: answers to validated arguments.

    @abc.abstractmethod
    def _knn(
        self, x: Queries, bound: Threshold, k: int, metric: Minkowski
    ) -> Neighbours:
        """`query`."""

    @abc.abstractmethod
    def _count(
        self, x: Queries, r: Threshold, metric: Minkowski
    ) -> Int[Array, "*batch"]:
        """`count_ball_point`."""

    @abc.abstractmethod
    def _collect(
        self, x: Queries, r: Threshold, max_neighbors: int, metric: Minkowski
    ) -> Ball:
        """`query_ball_point`, before its overflow check."""

    def _check_other(self, other) -> None:
        if not isinstance(other, AbstractKDTree):
            raise TypeError(
                f"`other` must be a kdeqx tree, got {type(other).__name__}."
            )
        if other.d != self.d:
            raise ValueError(
                f"`other` has points of dimension {other.d}, this tree {self.d}."
            )

    def _pair_count(
        self,
        r: Float[Array, ""],
        metric: Minkowski,
        other: "AbstractKDTree | None" = None,
    ) -> Int[Array, ""]:
        """The ordered pairs `(x, y)` within `r`, `x` of this tree and `y` of
        `other` (this tree: every `(i, i)` and both orders of each pair)."""
        other = self if other is None else other
        return other._counts_within(
            self._points().astype(other.dtype), r[None], metric, None, None
        )[0]

    @abc.abstractmethod
    def _points(self) -> Float[Array, "n d"]:
        """All the points, in their order."""

    @abc.abstractmethod
    def _pairs(
        self,
        x: Float[Array, "m d"],
        r: Float[Array, ""],
        capacity: int,
        metric: Minkowski,
        above: bool,
    ) -> _pairs_module.Pairs:
        """The pairs of a query and a point within `r` (with `above`, only point
        indices above the query's row), sorted, in `capacity` (`_pairs.Pairs`)."""

    @abc.abstractmethod
    def _self_pairs(
        self, r: Float[Array, ""], capacity: int, metric: Minkowski, sort: bool
    ) -> _pairs_module.Pairs:
        """The pairs of points `i < j` within `r` in `capacity`, sorted (or, if
        `sort` is False, in any order, padding last)."""

    @abc.abstractmethod
    def _self_matrix(
        self, r: Float[Array, ""], capacity: int, metric: Minkowski
    ) -> _pairs_module.Pairs:
        """Every pair of points `(i, j)` within `r`, both ways and `i = j` included,
        sorted, in `capacity`."""

    @abc.abstractmethod
    def _counts_within(
        self,
        x: Float[Array, "m d"],
        radii: Float[Array, " radii"],
        metric: Minkowski,
        x_weights: Float[Array, " m"] | None,
        weights: Float[Array, " n"] | None,
    ) -> Array:
        """`count_neighbors` for ascending radii (`_pairs.counts_within`)."""

    @abc.abstractmethod
    def _knn_rows(
        self, x: Queries, k: int, values: Float[Array, "n ..."], metric: Minkowski
    ) -> tuple[Float[Array, "*batch k"], Int[Array, "*batch k"], Array]:
        """`query(x, k)` and the neighbours' rows of `values`, `(*batch, k, ...)`
        (any finite row at a missing neighbour)."""


# The default leaves' slots; each leaf is also split in halves (`KDTree`).
DEFAULT_LEAF_SIZE = 32


class KDTree(AbstractSearchTree, AbstractKDTree):
    """An exact k-d tree over `n` points in `d` dimensions, built and queried in JAX.

    The tree is a balanced median-split k-d tree stored as flat arrays in heap order
    (node `i` has children `2i + 1` and `2i + 2`), with `2**depth` leaves (buckets) of
    `leaf_size` slots each; by default each leaf is also split at a median into two
    halves with boxes of their own, which queries for few neighbours walk as one
    more level of leaves. Every array is a pytree leaf, so a tree can be built under
    `jax.jit`, batched with `jax.vmap`, saved with `eqx.tree_serialise_leaves` and
    passed into jitted functions without baking its data into the program. Queries
    walk the tree in one `lax.while_loop`, so their compiled program does not depend
    on `n`.

    Gradients: distances and interpolated values are differentiable with respect to
    the query points and to `points`. The other arrays are derived search structures,
    built without gradient.
    """

    checks_traced_inputs: ClassVar[bool] = True

    points: Float[Array, "n d"]
    leaf_points: Float[Array, "slots d"]
    leaf_indices: Int[Array, " slots"]
    node_lo: Float[Array, "d nodes"]
    node_hi: Float[Array, "d nodes"]
    node_min_index: Int[Array, " nodes"]
    period: Float[Array, " d"] | None
    scale: Float[Array, ""]
    leaf_size: int = eqx.field(static=True)
    split_queries: bool = eqx.field(static=True)
    engine: str = eqx.field(static=True)

    def __init__(
        self,
        points: ArrayLike,
        *,
        box: None | float | ArrayLike = None,
        leaf_size: int | None = None,
        split_queries: bool = True,
        engine: str = "auto",
        leafsize: int | None = None,
        boxsize: None | float | ArrayLike = None,
    ):
        """**Arguments:**

        - `points`: the data, shape `(n, d)` with `d >= 1`. float32 and float64 are
            kept as given, float64 where JAX has x64 enabled (with it off, JAX's
            default, JAX holds float64 input as float32); integers are promoted to
            the default float dtype. Must be
            finite: NaN/inf raise `ValueError` eagerly, and an `eqx.error_if` runtime
            error under `jax.jit`. `n = 0` gives an empty tree, whose queries return
            only the missing-neighbour sentinels.
        - `box`: periodic boundaries, as in scipy's `boxsize`: `None` (default) for
            none, or the box lengths `L`, a scalar or one per axis `(d,)`; an axis
            with a length `<= 0` is not periodic. Every query then measures
            minimum-image distances. Coordinates on periodic axes are taken modulo
            `L` (so points just outside `[0, L)` from round-off are wrapped, not
            rejected); `points` itself is kept as given.
        - `leaf_size`: points per leaf bucket (a static Python int `>= 1`, or `None`;
            like scipy's `leafsize`, a tuning parameter: answers do not depend on
            it). Larger leaves make a shallower tree and more brute-force work per
            visited leaf; powers of two build fastest. `None` (default): leaves of
            32, each also split in two halves of 16 with boxes of their own, which
            the queries for at most 16 nearest neighbours (`query`, `interpolate`
            with the nearest) walk as leaves: few neighbours are found faster in
            leaves of 16 (most of all in clustered data), radius counts and most
            larger `k` in leaves of 32, and much larger leaves are slower for every
            query (see `benchmarks/knn_k.py`, `--leaf-size`). An int gives leaves of
            that many slots to every query.
        - `split_queries`: on a CPU with several devices (for example after
            `jax.config.update("jax_num_cpu_devices", len(os.sched_getaffinity(0)))`,
            set before JAX starts: one device per core this process may use, as the
            demo does), split every batch of at least 256 queries per device over
            them: each device walks its share with its own lanes, nothing else is
            communicated, and the answers are the same. That answers kNN queries
            faster than one device's intra-op threads; more devices than cores make
            them slower (see `benchmarks/sharded.py`). `False` keeps queries on one
            device; queries that are already split, or inside a mesh or `shard_map`
            of the caller's, are never split again.
        - `engine`: how queries search the tree (static; the answers are the same).
            `"walk"`: each query walks the tree on its own, nearest subtrees first,
            many at once in one loop: the fastest on a CPU. `"blocks"`: queries go
            in blocks along a space-filling curve, and each block measures the
            leaves within its reach as dense tiles of distances, a few large array
            operations: the shape of work that a TPU or GPU runs well. `"auto"`
            (default): the walk where JAX's default backend is the CPU, blocks
            elsewhere, decided when the tree is built. Both run on every backend.
            `kNN`, radius counts and ball queries, `count_neighbors` and
            interpolation (the local fits too) take either; the pair and graph
            queries walk.
        - `leafsize`, `boxsize`: scipy's names for `leaf_size` and `box`, for scripts
            written for `scipy.spatial.cKDTree` (giving both names raises).
        """
        leaf_size = scipy_alias("leaf_size", leaf_size, "leafsize", leafsize)
        box = scipy_alias("box", box, "boxsize", boxsize)
        resolved = check_engine(engine)
        points = check_points("points", points)
        leaf_size = check_leaf_size(leaf_size)
        halves = leaf_size is None
        leaf_size = DEFAULT_LEAF_SIZE if leaf_size is None else leaf_size
        period = as_period(box, points.shape[1], points.dtype)
        arrays = build_search_arrays(points, leaf_size, period, halves)
        self.leaf_points, self.leaf_indices = arrays[:2]
        self.node_lo, self.node_hi, self.node_min_index, self.scale = arrays[2:]
        self.points = points
        self.period = period
        self.leaf_size = leaf_size
        self.split_queries = bool(split_queries)
        self.engine = resolved

    def _in_build_bucket(self) -> "KDTree":
        # The points padded to the build's rows (zeros, which no index refers to)
        # and the sentinel moved to that number, once per tree. Above
        # `_BUCKETED_UP_TO` points a tree answers as itself: the copy would cost
        # memory, and such trees are rarely rebuilt at varying sizes.
        rows = build_bucket(self.n, self.leaf_size)
        if rows == self.n or self.n == 0 or self.n > _BUCKETED_UP_TO:
            return self
        sources = _bucket_sources(self)
        key = id(self.leaf_indices)
        cached = _IN_BUILD_BUCKET.get(key)
        if cached is not None and cached[0] == sources:
            return cached[1]
        view = object.__new__(KDTree)
        for field in dataclasses.fields(self):
            object.__setattr__(view, field.name, getattr(self, field.name))
        indices = sentinels_moved(self.leaf_indices, self.node_min_index, self.n, rows)
        object.__setattr__(view, "points", pad_rows(self.points, rows, fill="zeros"))
        object.__setattr__(view, "leaf_indices", indices[0])
        object.__setattr__(view, "node_min_index", indices[1])
        _remember_bucket_view(self, key, sources, view)
        return view

    def _halves_as_leaves(self) -> "KDTree":
        """This tree one level deeper: each leaf's halves as leaves of their own (the
        same arrays, twice the leaves). Without halves, this tree itself."""
        if not self.halves:
            return self
        # Not through `__init__`, which builds: the same fields, `leaf_size` halved.
        tree = object.__new__(KDTree)
        for field in dataclasses.fields(self):
            object.__setattr__(tree, field.name, getattr(self, field.name))
        object.__setattr__(tree, "leaf_size", self.leaf_size // 2)
        return tree

    def _knn(self, x, bound, k, metric):
        return _knn.knn(self, x, bound, k, metric)

    def _count(self, x, r, metric):
        return _radius.count_ball_point(self, x, r, metric)

    def _collect(self, x, r, max_neighbors, metric):
        return _radius.query_ball_point(self, x, r, max_neighbors, metric)

    def _points(self):
        return self.points

    def _pairs(self, x, r, capacity, metric, above):
        return _pairs_module.pairs_within(self, x, r, capacity, metric, above)

    def _self_pairs(self, r, capacity, metric, sort):
        return _pairs_module.self_pairs(self, r, capacity, metric, sort)

    def _self_matrix(self, r, capacity, metric):
        return _pairs_module.self_matrix(self, r, capacity, metric)

    def _counts_within(self, x, radii, metric, x_weights, weights):
        return _pairs_module.counts_within(self, x, radii, metric, x_weights, weights)

    def _knn_rows(self, x, k, values, metric):
        no_bound = jnp.asarray(jnp.inf, x.dtype)
        distances, indices = self._knn(x, no_bound, k, metric)
        # Split like the queries on an explicit mesh; one program when called eagerly
        # (the gather's few operations would each compile on their own).
        return distances, indices, split_like_queries(_rows_at)(values, indices)


_rows_at = jax.jit(rows_at)

# Trees of at most this many points answer eager queries as their build bucket.
_BUCKETED_UP_TO = 1 << 20
# `id(tree.leaf_indices)` -> (the ids of the tree's arrays, its view as its build
# bucket): the view is made once per tree and dropped with it.
_IN_BUILD_BUCKET: dict[int, tuple[tuple, "KDTree"]] = {}


def _bucket_sources(tree: "KDTree") -> tuple:
    """What a view as the build bucket is made from: the tree's arrays (compared
    by identity, through weak references, so that a freed array's reused id cannot
    match) and its static fields."""
    arrays = [getattr(tree, field.name) for field in dataclasses.fields(tree)]
    return tuple(_Same(a) if isinstance(a, jax.Array) else a for a in arrays)


class _Same:
    """Equal to another `_Same` of the very same (still living) array."""

    def __init__(self, array: jax.Array):
        self.ref = weakref.ref(array)

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, _Same)
            and self.ref() is not None
            and (self.ref() is other.ref())
        )

    __hash__ = None  # pyright: ignore[reportAssignmentType]


def _remember_bucket_view(tree: "KDTree", key: int, sources, view: "KDTree") -> None:
    # The entry lives as long as the tree's `leaf_indices` (its key), which the view
    # does not hold (it holds the moved copy), so the entry keeps no tree alive.
    if key not in _IN_BUILD_BUCKET:
        weakref.finalize(tree.leaf_indices, _IN_BUILD_BUCKET.pop, key, None)
    _IN_BUILD_BUCKET[key] = (sources, view)


def _outer_reach(r: Array, metric: Minkowski) -> tuple[Array, Minkowski]:
    """The radius and exact norm within which an approximate search (`eps`) may
    return points: `r (1 + eps)`."""
    if metric.eps is None:
        return r, metric
    return r * (1 + metric.eps.astype(r.dtype)), Minkowski(metric.p)


def _capacity(
    capacity: int | None, argument: str, method: str, count: Callable[[], Array]
) -> int:
    """A static capacity: the one given, or, outside any transformation, the size
    bucket of the `count` that it must hold (counted now)."""
    if capacity is not None:
        return check_static_int(argument, capacity, 1)
    if not outside_any_trace():
        raise TypeError(
            f"{method}: under `jit`, `grad` or `vmap`, `{argument}` must be given: it "
            "fixes the shape of the answer. Call it once outside the transformation "
            f"without `{argument}` (the count is taken first), or pass a generous "
            "capacity with `raise_on_overflow=True`."
        )
    return bucket(max(1, int(count())))


_Answer = TypeVar("_Answer")


def _checked_capacity(
    answer: _Answer, count, capacity: int, method: str, argument: str, raise_on_overflow
) -> _Answer:
    """`answer` (every array of it, so that the check stays whichever is used),
    carrying an error if `raise_on_overflow` and `count` exceeds the capacity:
    eagerly a `ValueError` with the capacity needed, under `jit` a runtime error."""
    if not raise_on_overflow:
        return answer
    if is_concrete(count):
        if int(count) > capacity:
            raise ValueError(
                f"{method}: {int(count)} neighbours or pairs, more than "
                f"{argument}={capacity}: pass {argument}={int(count)} or more, or "
                f"leave `{argument}` out (outside `jit`) to have it counted."
            )
        return answer
    return eqx.error_if(
        answer,
        count > capacity,
        f"{method}: more than {argument}={capacity} neighbours or pairs lie within "
        f"the distance; pass a larger `{argument}`, at least the returned count "
        f"(for `query_ball_point`, the largest of `counts`).",
    )


def _split_weights(weights, tree: AbstractKDTree, other: AbstractKDTree):
    """scipy's `weights` of `count_neighbors` as `(self's, other's)`, each checked,
    or `None` for unweighted points."""
    if weights is None:
        return None, None
    if isinstance(weights, tuple):
        if len(weights) != 2:
            raise ValueError(
                "`weights` as a tuple must be `(weights_self, weights_other)`, got "
                f"{len(weights)} entries."
            )
        first, second = weights
    else:
        if other is not tree:
            raise ValueError(
                "One `weights` array is for a tree counted with itself; for two "
                "trees pass `(weights_self, weights_other)`."
            )
        first = second = weights
    return (
        None if first is None else check_weights(first, tree.n, other.dtype),
        None if second is None else check_weights(second, other.n, other.dtype),
    )


def _broadcast_to_batch(name: str, value: Array, batch: tuple[int, ...]) -> Array:
    """A per-query argument broadcast to the queries' batch shape."""
    try:
        fits = np.broadcast_shapes(value.shape, batch) == batch
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"`{name}` must be a scalar or broadcast to the queries' batch shape "
            f"{batch}, got shape {tuple(value.shape)}."
        )
    return jnp.broadcast_to(value, batch)


def _findable(wanted: int, n: int) -> int:
    """How many of `wanted` neighbours a search can find among `n` points (at least
    one, so that an empty tree still answers with sentinels)."""
    return max(1, min(wanted, n))


def _padded(
    neighbours: tuple[Float[Array, "*batch found"], Int[Array, "*batch found"]],
    width: int,
    n: int,
) -> tuple[Float[Array, "*batch width"], Int[Array, "*batch width"]]:
    """Distances and indices padded with the sentinels `(inf, n)` to `width`."""
    distances, indices = neighbours
    missing = width - distances.shape[-1]
    if missing == 0:
        return distances, indices
    pad = [(0, 0)] * (distances.ndim - 1) + [(0, missing)]
    return (
        jnp.pad(distances, pad, constant_values=jnp.inf),
        jnp.pad(indices, pad, constant_values=n),
    )


def check_points(
    name: str, points: ArrayLike, *, traced: bool = True
) -> Float[Array, "n d"]:
    """Data points: shape `(n, d)`, real and finite (see `check_finite`)."""
    points = as_float_array(name, points)
    check_points_shape(name, points)
    return check_finite(name, points, traced=traced)


def scipy_alias(name: str, value, scipy_name: str, scipy_value):
    """The value of an argument that may also be given by scipy's name for it."""
    if scipy_value is None:
        return value
    if value is not None:
        raise TypeError(
            f"`{name}` and `{scipy_name}` (scipy's name for it) were both given; "
            "give one."
        )
    return scipy_value


def check_workers(workers) -> None:
    """scipy's `workers`: `None` or an int (`-1`: every core), which changes nothing
    here."""
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, int)
    ):
        raise TypeError(f"`workers` must be an int or None, got {workers!r}.")


def refuse_output_type(output_type, method: str, converters: str) -> None:
    """scipy's `output_type`, which kdeqx answers with arrays and converters."""
    if output_type is not None:
        raise TypeError(
            f"{method}: `output_type` is scipy's; kdeqx returns arrays (fixed "
            f"shapes, for JAX). Convert them with {converters}."
        )


def check_engine(engine: str) -> str:
    """`engine` as `"walk"` or `"blocks"` (`"auto"`: the walk on a CPU)."""
    if engine not in ("auto", "walk", "blocks"):
        raise ValueError(
            f'`engine` must be "auto", "walk" or "blocks", got {engine!r}.'
        )
    if engine == "auto":
        return "walk" if jax.default_backend() == "cpu" else "blocks"
    return engine


def check_leaf_size(leaf_size: int | None) -> int | None:
    """A leaf size, or `None` for the default leaves (see `KDTree`)."""
    return None if leaf_size is None else check_static_int("leaf_size", leaf_size, 1)


def check_ranks(k: int | Sequence[int]) -> tuple[int, ...]:
    """`k` as the ranks it asks for, counted from 1 (scipy's `k`)."""
    if isinstance(k, Sequence) and not isinstance(k, str):
        if len(k) == 0:
            raise ValueError("`k` must name at least one rank, got an empty sequence.")
        return tuple(check_static_int("k", rank, 1) for rank in k)
    return tuple(range(1, check_static_int("k", k, 1) + 1))
