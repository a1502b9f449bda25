from jaxtyping import Array, ArrayLike, Bool, Float, Int, PyTree, UInt


# The shapes of a query's arguments and answers, as the tree types pass them around.
Queries = Float[Array, "*batch d"]
# A distance (an upper bound or a radius): one shared by all queries, or one each.
Threshold = Float[Array, "*batch"] | Float[Array, ""]
Neighbours = tuple[Float[Array, "*batch k"], Int[Array, "*batch k"]]
# Distances and indices at most `m`, and the true counts.
Ball = tuple[Float[Array, "*batch m"], Int[Array, "*batch m"], Int[Array, "*batch"]]


__all__ = [
    "Array",
    "ArrayLike",
    "Ball",
    "Bool",
    "Float",
    "Int",
    "Neighbours",
    "PyTree",
    "Queries",
    "Threshold",
    "UInt",
]
