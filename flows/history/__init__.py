"""Reading past runs: listing and reproducing them, and a model's lineage back to its bytes."""
