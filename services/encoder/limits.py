"""Message bounds of the Encoder service (bytes), without torch: the router imports them."""

CHUNK_BYTES = 2 << 20  # a Fetch message's bound (bytes): under gRPC's 4 MiB default
MESSAGE_OVERHEAD = 64  # bytes an EmbeddingChunk adds to its data (field tags, varints), at most
MAX_SUBMIT_BYTES = 256 << 20  # the largest Submit message (the items' raw media together)
MAX_EMBEDDING_BYTES = 1 << 30  # a reader's default bound on one item's embeddings
