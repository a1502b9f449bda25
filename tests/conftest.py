import os

import jax
from hypothesis import HealthCheck, settings


# float64 tests need x64; float32 tests pass dtypes explicitly, so it is harmless.
jax.config.update("jax_enable_x64", True)


# A modest number of examples in CI, the same ones every run (a red CI must mean a
# change broke something); `KDEQX_HYPOTHESIS_PROFILE=long` for a deep, random run.
settings.register_profile(
    "ci",
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long", parent=settings.get_profile("ci"), max_examples=500, derandomize=False
)
settings.load_profile(os.environ.get("KDEQX_HYPOTHESIS_PROFILE", "ci"))
