import jax


# float64 tests need x64; float32 tests pass dtypes explicitly, so it is harmless.
jax.config.update("jax_enable_x64", True)
