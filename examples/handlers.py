"""README "A handler function": the handler the adapter of run_adapter.py runs
(``handlers:restart``)."""


def call_ops_api(service: str, idempotency_key: str) -> bool:
    """Stands for the operations API the handler calls (it dedupes by the key)."""
    return bool(service and idempotency_key)


from broker_adapter import RetryableError, Task

def restart(task: Task) -> dict:
    if task.cancelled():                         # cancel is durable; check it in long work
        return {}
    ok = call_ops_api(task.payload["service"], idempotency_key=task.idempotency_key)
    if not ok:
        raise RetryableError("ops API busy")      # retried with capped exponential backoff
    return {"restarted": task.payload["service"]}  # becomes the reply's result
