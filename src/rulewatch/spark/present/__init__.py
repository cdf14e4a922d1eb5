"""What people look at: SQL views, the HTML report, alert exploration, notebook widgets."""
