"""Kafka edge: the embedded broker, topic administration, producers."""
