"""One module per loader backend (torch_backend, dali_backend with its graph dali_graph and its
probe dali_probe, synthetic, synthetic_decode, naive), and the device prefetcher they share
(prefetch). Named in `stallfree.data.registry`; imported only when chosen."""
