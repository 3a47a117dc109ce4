"""GCache: the L3 KV page cache node service (node, gRPC servicer, UCX data plane) and its clients."""
