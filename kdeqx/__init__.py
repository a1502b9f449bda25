"""kdeqx: exact k-d trees and operator series for JAX, as Equinox modules."""

import importlib.metadata

from ._backend import use_every_core as use_every_core
from ._backend._buckets import bucket as bucket, pad_to_bucket as pad_to_bucket
from ._graph._graph import (
    knn_graph as knn_graph,
    NeighborGraph as NeighborGraph,
    pad_points_to_bucket as pad_points_to_bucket,
    radius_graph as radius_graph,
)
from ._graph._neighbor_list import NeighborList as NeighborList
from ._interpolation._frozen import Frozen as Frozen
from ._interpolation._interpolate import Interpolator as Interpolator
from ._interpolation._kernels import (
    AbstractKernel as AbstractKernel,
    Gaussian as Gaussian,
    IDW as IDW,
    MLS as MLS,
    RBF as RBF,
)
from ._query._convert import (
    ball_lists as ball_lists,
    distance_dict as distance_dict,
    pair_array as pair_array,
    pair_set as pair_set,
    to_scipy_sparse as to_scipy_sparse,
)
from ._tree._sharded import ShardedKDTree as ShardedKDTree
from ._tree._tree import AbstractKDTree as AbstractKDTree, KDTree as KDTree
from .series import OperatorSeries as OperatorSeries


__version__ = importlib.metadata.version("kdeqx")
