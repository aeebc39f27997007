"""The decision pipeline between the protocol shell and the pure core."""
