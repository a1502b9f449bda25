"""The operator series `X_0 .. X_K` of `X_k = i[H(t), X_{k-1}] + dX_{k-1}/dt`, by
Taylor arithmetic in one `lax.scan`: a subsystem of its own, sharing nothing with the
trees."""

from ._series import OperatorSeries as OperatorSeries
