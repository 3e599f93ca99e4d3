"""flashtier.kvstore."""
