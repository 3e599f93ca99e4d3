"""flashtier.server."""
