"""Spark edge: the session, the Kafka source and sink, the streaming jobs."""
