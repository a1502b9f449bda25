"""Interpolation: the kernels, the local fits and their dense solves, and the
trainable `Interpolator`."""
