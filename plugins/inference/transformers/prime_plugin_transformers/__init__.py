"""prime-plugin-transformers: the ``transformers`` inference backend (transformers' continuous
batching with paged attention behind a small HTTP server, with live weight updates)."""
