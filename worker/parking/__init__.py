"""Parking: where a URL its source cannot take now waits in Kafka, and what hands it back."""
