"""A real local stack (Kafka, Redis, S3) from PyPI wheels: no Docker needed."""
