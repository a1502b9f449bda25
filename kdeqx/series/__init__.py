"""The operator series `X_0 .. X_K` of `X_k = i[H(t), X_{k-1}] + dX_{k-1}/dt`, by
Taylor arithmetic: a subsystem of its own, sharing with the trees only the backend
tricks of `kdeqx/_backend/`."""

from ._series import OperatorSeries as OperatorSeries
