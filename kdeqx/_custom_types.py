from jaxtyping import Array, ArrayLike, Bool, Float, Int, PyTree, UInt


__all__ = ["Array", "ArrayLike", "Bool", "Float", "Int", "PyTree", "UInt"]
