"""The pipeline's stages, one sub-package (a room) each: ``ingest``, ``worker``,
``dispatch``, ``receiver`` and ``reconcile``.

A stage reads from and writes to Redis (``broker_adapter.redis``) and the store
(``broker_adapter.store``); stages meet only through those tables and streams and never
import one another. What several stages use (the idle policy, the reply publisher, trace
context, the handler runtime, the hand-off) is in ``shared``, which imports no stage.
Import-linter contracts check both rules.
"""
