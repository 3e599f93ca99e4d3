"""flashtier.engine."""
