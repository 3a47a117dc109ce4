"""The encoder service's sans-IO core (issue 18, EPD): the embedding cache keyed by an item's
content key (``cache``: LRU by bytes in one process, plus in-flight dedupe), its per-machine tier in
POSIX shared memory (``shm_cache``), the scheduler that fuses the images and audio of many requests
into bounded batches and splits the outputs back (``batcher``), and the choice of an encoder for an
item by rendezvous hashing with a load bound (``placement``). Plain classes with an injected clock:
no sockets and no threads; the encoder service's shell drives them. Patterned on SGLang's EPD
encoder (``EncoderScheduler``, ``MultiModalStaticCache``) and vLLM's ``EncoderCacheManager``."""
