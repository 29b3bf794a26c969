"""The router's tasks as MCP tools: what ``broker-adapter mcp`` serves, without the transport.

Every task of the router is a tool: its input schema is the task's payload schema and its
description the handler's docstring. A call publishes a request through the ``AsyncClient``:

- a plain call waits for the reply and returns it (a reply that is not ``done`` is a tool
  error that says why);
- a call made as an MCP task returns at once; the MCP task id IS the request's message id,
  so polling, fetching the result and cancelling go through ``AsyncClient.result`` and
  ``AsyncClient.cancel``, and nothing of it lives in this process: a restarted MCP server
  answers for the tasks of the one before it.

The message id of a call (``tool_message_id``) is derived from the principal, a dedupe scope,
the tool's name and the canonical JSON of its arguments. A model that repeats a call with the
same arguments (a retry after a lost answer, a re-planned step) within one scope makes one
request: the adapter answers the copy as a duplicate and the handler runs once. The scope is
the caller's ``_meta`` key ``broker_adapter/key`` when it sends one (a key of its own for a
unit of work), else the MCP session's (one per connection), so that the same arguments asked
in another session are a new request. A random id per call would make every retry a second
run, which is what this server exists to prevent.

Two more tools read, never write: ``task_status`` (a request's reply by message id) and
``dead_letters`` (this principal's dead letters).
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime
from typing import Any

from mcp import types

from broker_adapter.client.request import AsyncClient
from broker_adapter.errors import RedisUnavailable, RequestTimeout
from broker_adapter.handler.router import Router
from broker_adapter.protocol.canonical import canonical_json, sha256_hex
from broker_adapter.protocol.reply import Reply

log = logging.getLogger("broker_adapter.app.mcp")

#: A request in flight: the task that ends with its reply, and the event set once it was
#: published (or its reply found recorded).
_Asking = tuple["asyncio.Task[Reply | None]", asyncio.Event]

#: The tools every server has beside the router's.
STATUS_TOOL = "task_status"
DEAD_LETTERS_TOOL = "dead_letters"
#: The ``_meta`` key a caller may send to name its own dedupe scope.
SCOPE_META_KEY = "broker_adapter/key"
#: What an MCP client is told to wait between polls of a task, milliseconds.
POLL_INTERVAL_MS = 500
#: How long ``tasks/result`` waits for a reply before it answers that the task still runs.
RESULT_WAIT_S = 60.0
#: The most dead letters ``dead_letters`` returns.
DEAD_LETTERS_MAX = 100

#: A reply status as an MCP task status.
TASK_STATUS = {
    "done": "completed",
    "cancelled": "cancelled",
    "failed": "failed",
    "expired": "failed",
    "hop_limit": "failed",
    "conflict": "failed",
}


def tool_message_id(principal: str, scope: str, tool: str, arguments: dict[str, Any]) -> str:
    """The message id of a tool call: ``"mcp-"`` + the first 40 hex digits of SHA-256 over
    the canonical JSON of ``{"arguments", "principal", "scope", "tool"}``."""
    content = {"arguments": arguments, "principal": principal, "scope": scope, "tool": tool}
    return "mcp-" + sha256_hex(canonical_json(content))[:40]


def reply_result(reply: Reply) -> types.CallToolResult:
    """A reply as a tool result: ``done`` is its result (structured, and as JSON text);
    any other status an error naming the status and the reply's error."""
    if reply.status == "done":
        result = reply.result
        structured = result if isinstance(result, dict) else {"result": result}
        text = json.dumps(result, sort_keys=True, ensure_ascii=False)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)], structuredContent=structured
        )
    return _error(
        f"{reply.status}: {reply.error or 'no error text'} (message id {reply.message_id})"
    )


def _error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], isError=True)


def _json_result(value: Any) -> types.CallToolResult:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    structured = value if isinstance(value, dict) else {"items": value}
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=text)], structuredContent=structured
    )


class ToolBridge:
    """The MCP requests a server answers, in terms of a router and a client.

    Args:
        router: the tasks to offer (names, payload schemas, docstrings).
        client: publishes the requests and reads their replies.
        timeout_s: how long a plain call waits for its reply.
        deadline_s: each request's deadline, seconds from its first publication.
    """

    def __init__(
        self,
        router: Router,
        client: AsyncClient,
        *,
        timeout_s: float,
        deadline_s: float,
    ) -> None:
        self.router = router
        self.client = client
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self._created: dict[str, datetime] = {}
        self._asking: dict[str, _Asking] = {}

    def tools(self) -> list[types.Tool]:
        """The router's named tasks, then ``task_status`` and ``dead_letters``."""
        found = [
            types.Tool(
                name=spec["name"],
                description=spec["description"] or f"Run the task {spec['name']!r}.",
                inputSchema=spec["payload"],
                execution=types.ToolExecution(taskSupport="optional"),
            )
            for spec in self.router.schemas()
            if spec["name"] is not None
        ]
        message_id = {"message_id": {"type": "string", "description": "the request's id"}}
        found.append(
            types.Tool(
                name=STATUS_TOOL,
                description="The reply to an earlier request of this principal, by message id"
                " (the MCP task id of a call made as a task), or that none is recorded yet.",
                inputSchema={
                    "type": "object",
                    "properties": message_id,
                    "required": ["message_id"],
                },
            )
        )
        found.append(
            types.Tool(
                name=DEAD_LETTERS_TOOL,
                description="This principal's dead letters: requests and replies refused, with"
                " the reason each was refused.",
                inputSchema={
                    "type": "object",
                    "properties": {"limit": {"type": "integer", "minimum": 1, "maximum": 100}},
                },
            )
        )
        return found

    async def call(
        self, name: str, arguments: dict[str, Any], *, as_task: bool, scope: str
    ) -> types.CallToolResult | types.CreateTaskResult:
        """A ``tools/call``: a router task (waited for, or as an MCP task) or a read tool."""
        if name == STATUS_TOOL:
            reply = await self.client.result(str(arguments.get("message_id", "")))
            if reply is None:
                return _json_result({"status": "no reply recorded yet"})
            return _json_result(dict(reply.body))
        if name == DEAD_LETTERS_TOOL:
            limit = int(arguments.get("limit") or DEAD_LETTERS_MAX)
            letters = await self.client.dead_letters(min(limit, DEAD_LETTERS_MAX))
            return _json_result(letters)
        if self.router.get(name) is None:
            raise ValueError(f"unknown tool {name!r}")
        message_id = tool_message_id(self.client.principal, scope, name, arguments)
        asking = self._asking.get(message_id)
        if asking is None:  # registered before any await: every copy of the call shares it
            asking = self._ask(name, arguments, message_id)
        reply_task, sent = asking
        if as_task:
            await sent.wait()  # published once (or answered from the record) before we say so
            found = (
                reply_task.result() if reply_task.done() and not reply_task.cancelled() else None
            )
            if found is not None:
                return self._answer(message_id, found, as_task=True)
            return types.CreateTaskResult(task=self._task(message_id, "working", None))
        reply = await asyncio.shield(reply_task)
        if reply is None:
            return _error(
                f"no reply within {self.timeout_s:g} s; the request {message_id} stays valid:"
                f" ask {STATUS_TOOL} for it later"
            )
        return reply_result(reply)

    def _answer(
        self, message_id: str, reply: Reply, *, as_task: bool
    ) -> types.CallToolResult | types.CreateTaskResult:
        if not as_task:
            return reply_result(reply)
        status = TASK_STATUS.get(reply.status or "", "failed")
        return types.CreateTaskResult(task=self._task(message_id, status, reply.error))

    def _ask(self, name: str, arguments: dict[str, Any], message_id: str) -> _Asking:
        """Start the request in a task of its own that every copy of the call shares: the
        reply recorded by an earlier call, if any; else one envelope (so one deadline,
        whichever copy came first) published, then resent unchanged until its reply comes
        (``None`` after ``timeout_s``). ``sent`` is set once it was published (or found)."""
        sent = asyncio.Event()

        async def ask() -> Reply | None:
            try:
                known = await self.client.result(message_id)
                if known is not None:
                    return known
                envelope = self.client.envelope(name, arguments, message_id, self.deadline_s)
                try:
                    await self.client.publisher.publish(envelope)
                except RedisUnavailable as exc:
                    log.info("request %s not confirmed yet, resending: %s", message_id, exc)
                sent.set()
                return await self.client.send(envelope, self.timeout_s)
            except RequestTimeout:
                return None
            finally:
                sent.set()

        def done(task: asyncio.Task[Reply | None]) -> None:
            self._asking.pop(message_id, None)
            if not task.cancelled() and task.exception() is not None:
                log.warning("request %s: %s", message_id, task.exception())

        reply_task = asyncio.create_task(ask(), name=f"mcp-request-{message_id}")
        self._asking[message_id] = (reply_task, sent)
        self._created.setdefault(message_id, datetime.now(UTC))
        reply_task.add_done_callback(done)
        return reply_task, sent

    def _task(self, message_id: str, status: str, message: str | None) -> types.Task:
        now = datetime.now(UTC)
        return types.Task(
            taskId=message_id,
            status=status,
            statusMessage=message,
            createdAt=self._created.get(message_id, now),
            lastUpdatedAt=now,
            ttl=int(self.deadline_s * 1000),  # the request's deadline, as ms
            pollInterval=POLL_INTERVAL_MS,
        )

    async def status(self, message_id: str) -> types.GetTaskResult:
        """``tasks/get``: the reply's status, or ``working`` while none is recorded."""
        reply = await self.client.result(message_id)
        if reply is None:
            task = self._task(message_id, "working", "no reply recorded yet")
        else:
            status = TASK_STATUS.get(reply.status or "", "failed")
            task = self._task(message_id, status, reply.error or reply.status)
        return types.GetTaskResult(**task.model_dump())

    async def result(self, message_id: str) -> types.CallToolResult:
        """``tasks/result``: the reply as a tool result, waited for up to ``RESULT_WAIT_S``."""
        try:
            reply = await self.client.wait(message_id, RESULT_WAIT_S)
        except RequestTimeout:
            return _error(f"{message_id}: no reply yet; poll again")
        return reply_result(reply)

    async def cancel(self, message_id: str) -> types.CancelTaskResult:
        """``tasks/cancel``: a signed cancel of the request; the task reads ``cancelled``
        once the adapter has answered it (a running handler is asked to stop)."""
        await self.client.cancel(message_id)
        reply = await self.client.result(message_id)
        if reply is not None:
            status = TASK_STATUS.get(reply.status or "", "failed")
            task = self._task(message_id, status, reply.error or reply.status)
        else:
            task = self._task(message_id, "cancelled", "cancel requested")
        return types.CancelTaskResult(**task.model_dump())
