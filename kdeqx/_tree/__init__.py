"""The tree types and their build: `AbstractKDTree`, `KDTree`, `ShardedKDTree`."""
