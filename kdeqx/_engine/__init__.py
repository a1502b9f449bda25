"""The search engine: the abstract search tree, the walk (its visitors, k-best
merges and bit tricks), and what every query kind shares around it."""
