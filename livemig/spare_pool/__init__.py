"""Hot-spare daemons and pool bookkeeping."""
