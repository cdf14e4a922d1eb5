"""Live mode: the streaming queries, their monitor, the demo and its generated traffic."""
