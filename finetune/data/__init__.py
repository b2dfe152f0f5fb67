"""Data: loading files and hub datasets, tokenising into Arrow, caching, long documents, packing, streams
and the order of windows."""
