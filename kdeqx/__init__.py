"""kdeqx: exact k-d trees and operator series for JAX, as Equinox modules."""

import importlib.metadata

from ._interpolate import Interpolator as Interpolator
from ._series import OperatorSeries as OperatorSeries
from ._sharded import ShardedKDTree as ShardedKDTree
from ._tree import KDTree as KDTree


__version__ = importlib.metadata.version("kdeqx")
