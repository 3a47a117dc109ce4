"""GCache, the L3 KV page cache: keys, the page object format, the node's store and the ``L3Store``
interface the engine reads and writes it through (services/gcache is the node's process)."""
