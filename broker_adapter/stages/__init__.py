"""The pipeline's stages: ingest, worker, dispatcher, receiver, and the hand-off between them.

A stage reads from and writes to Redis (``broker_adapter.redis``) and the store
(``broker_adapter.store``); stages meet only through those tables and streams and never
import one another (an import-linter contract checks it). Helpers shared by several stages
(the idle policy, the handler calls, the ingress limits) and the parts of one stage
that are ideas of their own (the ingest's entry screening, ``intake``) live here beside them.
"""
