"""A collector in a process of its own, for the test that SIGKILLs it: ``FOLDER RUN PER_SHARD FORMAT``,
settings from the environment; it expects every input shard written so far."""
from __future__ import annotations

import sys
import threading
import uuid
from pathlib import Path

from common.settings import load_settings
from url_lists.dataset.collector import Collector, DatasetOptions
from url_lists.dataset.inputs import input_shards


def main() -> None:
    folder, run, per_shard, fmt = Path(sys.argv[1]), uuid.UUID(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    collector = Collector(DatasetOptions(folder=folder, output_format=fmt, per_shard=per_shard, image_size=640,
                                         run=run), load_settings())
    for shard in input_shards(folder):
        collector.expect(shard)
    collector.no_more_shards()
    collector.run(threading.Event())


if __name__ == "__main__":
    main()
