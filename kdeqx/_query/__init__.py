"""The query kinds, each a visitor of the engine: k nearest, radius counts and
collections, pairs; and converters to scipy's containers."""
