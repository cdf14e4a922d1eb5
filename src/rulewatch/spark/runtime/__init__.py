"""The processes Spark runs in: the session, its jars and class archive, Python workers, the environment."""
