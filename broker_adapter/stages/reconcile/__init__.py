"""The reconcile stage: asks what an ``unknown`` task's declared side effect did, and ends
the task, retries it, or leaves it to an operator (``reconciler``)."""
