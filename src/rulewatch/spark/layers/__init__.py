"""The medallion steps top to bottom: landing -> bronze -> silver -> gold, and the pipeline that runs them."""
