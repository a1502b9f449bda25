"""Neighbour graphs: cells, radius and kNN graphs, neighbour lists."""
