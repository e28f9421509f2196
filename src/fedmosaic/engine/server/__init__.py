"""The server side: cohorts, broadcast, exchange and aggregation of a round (``runtime.py``) and the task calendar."""
