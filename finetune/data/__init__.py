"""Data: loading files and hub datasets, tokenising into Arrow, caching, long documents, chat, packing, streams
and the order of windows."""
