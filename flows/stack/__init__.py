"""The local or team stack: its servers, their database, processes and the runs they left behind."""
