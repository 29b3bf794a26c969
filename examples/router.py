"""README "Using it": a Router of two tasks, served by
``broker-adapter run --app router:router`` and described by
``broker-adapter schema --app router:router``."""

from pydantic import BaseModel

from broker_adapter import Router


class RestartArgs(BaseModel):
    server: str


class SummariseArgs(BaseModel):
    doc: str


async def llm(doc: str) -> str:
    """Stands for a language model's API."""
    return doc[:80]


router = Router()                                          # ops/tasks.py
@router.task("restart", payload=RestartArgs)
def restart(task): return {"restarted": task.args.server}
@router.task("summarise", payload=SummariseArgs, call_timeout_s=120)
async def summarise(task): return {"text": await llm(task.args.doc)}
