"""Code both processes import: the contracts of SPEC.md, settings, logging, Kafka plumbing."""
