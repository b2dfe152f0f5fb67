"""The configuration: the one typed, frozen schema, batch arithmetic and multi-task specs."""
