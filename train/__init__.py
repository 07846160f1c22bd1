"""Entry scripts (``medusa.py``, ``evaluate.py``, ``export.py``) and the training spine they share."""
