"""The dispatch stage: publishes the replies no worker published (``dispatcher``), watches
for Redis data loss (``loss``) and re-sends what a lost epoch took (``replay``)."""
