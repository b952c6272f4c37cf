"""What samcache holds between turns, from the device down: the paged KV block pool
(:mod:`~samcache.cache.block_pool`) and the content index (:mod:`~samcache.cache.content_index`)
over the native core, the stores of ViT outputs and image KV (:mod:`~samcache.cache.stores`), and
the tiers below the device pool: host memory, local disk, a store shared by engine instances
(:mod:`~samcache.cache.tiers`)."""
