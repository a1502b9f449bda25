from jaxtyping import Array, ArrayLike, Bool, Float, Int


__all__ = ["Array", "ArrayLike", "Bool", "Float", "Int"]
