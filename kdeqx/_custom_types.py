from jaxtyping import Array, ArrayLike, Bool, Float, Int, PyTree


__all__ = ["Array", "ArrayLike", "Bool", "Float", "Int", "PyTree"]
