"""Kafka in and out: the transaction source, the alert topic, and a local broker for laptops and tests.

``broker`` starts a real Apache Kafka (KRaft mode) on loopback from jars fetched once at set-up;
``source`` reads a topic into bronze with the same columns as the landing folder plus the record's
coordinates; ``alerts`` publishes gold's alerts at least once (consumers deduplicate on ``alert_id``).
"""
