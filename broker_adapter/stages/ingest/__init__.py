"""The ingest stage: reads the inbound streams, screens each entry (``intake``, ingress
limits in ``limits``, cancels in ``cancels``) and commits accepted requests to the inbox
before acknowledging them (``ingest``; settings in ``config``)."""
