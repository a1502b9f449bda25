"""kdeqx: exact k-d trees and operator series for JAX, as Equinox modules."""

import importlib.metadata

from ._convert import (
    ball_lists as ball_lists,
    distance_dict as distance_dict,
    pair_array as pair_array,
    pair_set as pair_set,
    to_scipy_sparse as to_scipy_sparse,
)
from ._frozen import Frozen as Frozen
from ._graph import (
    knn_graph as knn_graph,
    NeighborGraph as NeighborGraph,
    radius_graph as radius_graph,
)
from ._interpolate import Interpolator as Interpolator
from ._neighbor_list import NeighborList as NeighborList
from ._sharded import ShardedKDTree as ShardedKDTree
from ._tree import AbstractKDTree as AbstractKDTree, KDTree as KDTree
from .series import OperatorSeries as OperatorSeries


__version__ = importlib.metadata.version("kdeqx")
