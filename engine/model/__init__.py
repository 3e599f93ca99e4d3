"""flashtier.engine.model."""
