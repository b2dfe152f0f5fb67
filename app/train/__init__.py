"""The Train tab: the config form generated from the schema, the Dataset panel (preview, columns, the first
conversation or pair, the Tasks table), the Plan panel and the Run panel with its results."""
