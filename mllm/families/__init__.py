"""Model families, one object each behind one interface (`base.py`), a module per family named for it."""
