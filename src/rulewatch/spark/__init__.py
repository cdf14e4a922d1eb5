"""Spark wiring: sessions, tables, and the ingest, parse, key, evaluate and sink stages around the engine."""
