"""Reports: tables and figures over run directories."""
