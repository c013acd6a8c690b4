"""A crawl's outcomes as an img2dataset-style dataset: keys, input shards, shard writers, the collector."""
